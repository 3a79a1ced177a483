"""The runtime: process groups, schedules as data, the executor, DDP and the optimizer."""
