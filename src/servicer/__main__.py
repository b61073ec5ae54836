import os
import sys

# The scheduler is started by fork+exec: gRPC's fork handlers are not needed, and with
# them on, every start logs "Other threads are currently calling into gRPC...".
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from .cli import main  # noqa: E402  (after the environment is set)

sys.exit(main())
