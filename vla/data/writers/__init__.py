"""Dataset writers: LeRobot v3.0 (sim generation, conversion) and RLDS (tests, benchmarks, round trips)."""
