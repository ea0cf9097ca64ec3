"""Measuring tools: `rlspec bench`, the TRL reference row, the weight-sync bench and the profilers."""
