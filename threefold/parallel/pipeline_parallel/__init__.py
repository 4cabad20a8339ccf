"""Pipeline parallelism: which layers each stage holds, the 1F1B / interleaved schedules and
the point-to-point sends between stages."""
