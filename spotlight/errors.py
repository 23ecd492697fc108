"""Named errors of the engine. Each message says what went wrong and how to fix it.

They subclass ValueError (bad user or config input); entry points print the message
without a traceback.
"""


class SpotlightError(ValueError):
    """Base class for the engine's user-facing errors."""


class ModelNotFound(SpotlightError):
    """The model path does not exist or cannot be read."""


class UnsupportedModel(SpotlightError):
    """The model exists but its architecture or format is not supported."""


class CorruptModel(SpotlightError):
    """A model file is there but its bytes are damaged or cut short (the message says how to restore it)."""


class HomeNotWritable(SpotlightError):
    """The data directory (SPOTLIGHT_HOME) cannot be written."""


class ContextTooLong(SpotlightError):
    """A prompt does not fit the model's context window."""


class EncoderMismatch(SpotlightError):
    """A Spotlight encoder checkpoint does not belong to this model or configuration."""


class CorruptCheckpoint(SpotlightError):
    """A checkpoint file is unreadable or incomplete."""


class DeviceUnavailable(SpotlightError):
    """A device (CUDA) was requested but is not available."""


class CorpusEmpty(SpotlightError):
    """A training or evaluation corpus holds no usable text."""


class TooMuchMemory(SpotlightError):
    """A job would need more memory than this machine has free (it says what to lower)."""


class TrainingRunning(SpotlightError):
    """Encoders are being trained already (one training at a time)."""
