"""The coordinator: hands out the run, serves data and checkpoints, supervises the auxiliary peer. Never imports torch."""
