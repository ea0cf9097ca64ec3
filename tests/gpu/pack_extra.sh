#!/usr/bin/env bash
# Fill .devicepkgs/extra (git-ignored) with the wheels tests/gpu/measure.sh installs on the GPU machine besides
# .devicepkgs' own packages (ray, deepspeed, hydra), for its Python 3.12: the serve stack the server's GPU tests
# start (fastapi, starlette, uvicorn with uvloop and httptools, httpx and their pure-Python dependencies,
# opentelemetry-api and annotated-doc included), the openai client the agent tests use, and TRL with datasets for
# the TRL reference rows (`rlspec bench --reference trl`), and py-spy (the `serveprofile` section's sampler). Run from the project root, with the package index reachable:
#   bash tests/gpu/pack_extra.sh
# then carry .devicepkgs as usual (about 6 MB more). The serve and openai versions are those `pip install -e ".[all]"`
# resolves here; TRL is the 1.16 of the quoted TRL figures, with the datasets, dill, multiprocess and xxhash that
# resolved beside it. Packages the GPU machine's image already has (torch, transformers, accelerate, numpy, pyarrow,
# pydantic) are not downloaded.
set -eu
DEST=.devicepkgs/extra
mkdir -p "$DEST"
SERVE="fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0
  sniffio==1.3.1 idna==3.20 certifi==2026.10.19.post1 opentelemetry-api==1.45.2 annotated-doc==0.0.7 click==8.5.1
  uvloop==0.23.0 httptools==0.9.0"
AGENTS="openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 distro==1.9.0 jiter==0.19.0"
TRL="trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0"
PROFILE="py-spy==0.4.3"
# shellcheck disable=SC2086  # the lists are split into requirements on purpose
python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" $SERVE $AGENTS $TRL $PROFILE
ls "$DEST"
