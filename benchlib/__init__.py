"""Helpers the benchmark scripts in bench/ share (load generation, provenance, the zero-work
front comparison); not benchmarks themselves, so they live outside bench/, where every script
must run with --quick."""
