"""The training program each worker runs (``python -m trainer``); no Prefect inside."""

__version__ = "0.1.0"

import warnings

# torch.cuda imports the deprecated ``pynvml`` shim that NVRx pulls in; the warning is noise in
# every worker's log.
warnings.filterwarnings("ignore", message="The pynvml package is deprecated")
