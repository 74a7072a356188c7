"""DeepSpeed adapter (the ``deepspeed`` extra). Importing this package does not import deepspeed: the
functions that need it import it when an engine is handed to them."""
from gradloc.parallel.zero.grads import DeepSpeedGradAccess

__all__ = ["DeepSpeedGradAccess"]
