"""The pipeline's exception hierarchy. Which of these a stage retry may fix is decided in exactly
one place: :mod:`tasks.retry_policy`."""

from __future__ import annotations


class PipelineError(Exception):
    """Base of every failure the pipeline reports with a cause."""


class PreflightFailed(PipelineError):
    pass


class HydrationError(PipelineError):
    pass


class StorageError(PipelineError):
    """S3 unreachable, missing bucket, bad credentials: the message says which."""


class AwsConfigError(PipelineError):
    """The AWS configuration cannot be used (a profile that does not exist, an unparsable config
    file, a malformed region): the message names the variable or field to fix."""


class TrainingFailed(PipelineError):
    """The train stage ended without completing all steps."""


class NodeLost(TrainingFailed):
    """A node was lost and the in-job layer could not continue without it: a whole-stage retry
    on the nodes available, from the newest valid checkpoint, is the remedy."""


class CapacityNotRestored(TrainingFailed):
    """Too few healthy nodes came back within ``eks.node_wait_s`` after a loss: another attempt
    now would only sit unschedulable. Not retried; the run is resumed (same run id) when
    capacity is back."""


class InJobExhausted(TrainingFailed):
    """ft_launcher used up ``--max-restarts`` on faults that kept coming back (no node lost)."""


class DoNotRequeue(TrainingFailed):
    """No restart can fix it (bad configuration, bad data, no valid checkpoint): a worker wrote
    the ``control/no_restart`` marker or a fatal event, or a launcher exited 93. Never retried."""


class FenceBusy(TrainingFailed):
    """The new attempt's epoch could not be published: the run root's fence lock stayed held
    past its timeout (a writer frozen while holding it). Nothing was launched; a stage retry
    publishes again, once the holder thawed or died."""


class TrainTimeout(TrainingFailed):
    """The train stage's own deadline passed."""


class ValidationFailed(PipelineError):
    pass


class ExportError(PipelineError):
    pass


class PullError(PipelineError):
    """An export could not be pulled, or did not verify: nothing was left at the destination."""


class PullUsageError(PullError):
    """The pull cannot start as asked: S3_URI names no export prefix, or DIR cannot take it (not
    a directory, or holding something else). The message names the argument and the fix."""
