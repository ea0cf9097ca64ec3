"""The run's machinery: metrics and timers, checkpoints, the monitor (NaN guard, SIGTERM) and the stall watchdog."""
