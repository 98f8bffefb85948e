"""``python -m trainer --config FILE [overrides]``: the worker entry point ft_launcher runs.

``python -m trainer.train`` entered through a module that imports nothing at its top level: a
spawned helper (NVRx's checkpoint writer, its results-queue Manager) first re-imports the
parent's ``__main__``, which as ``trainer.train`` is torch and the whole trainer, on the
restart's critical path. Entered here, the Manager starts in ~0.1 s instead of 2.4-3.8 s.
"""

if __name__ == "__main__":
    import gc
    import sys

    from trainer import notice

    notice.install()  # before torch's import: an eviction's notice may come at any time
    from trainer.train import main

    try:
        sys.exit(main())
    finally:
        # The interpreter's last garbage collection walks every object torch made: 1-2 s of a
        # worker's exit (a crash's too), on the attempt's and the restart's critical path.
        # Frozen objects are not walked; atexit handlers (the writer's, the Manager's) still run.
        gc.freeze()
