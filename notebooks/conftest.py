"""pytest set-up for the notebooks that nbval runs (`make test`, `make test-zh`, `make test-gpu`).

nbval's kernels talk to pytest over Unix sockets in a private temporary folder instead of TCP ports on 127.0.0.1.
Why: jupyter_client chooses a kernel's five TCP ports by binding port 0 and closing the socket again, and the kernel
binds them about a second later, once Python has started. Under `make test`'s two workers, anything else that binds
port 0 in that second (the other worker's kernel, or an inference server a notebook starts) can take one of them.
The kernel then exits with "Address already in use", and nbval reports "Kernel died before replying to kernel_info"
for every cell of the notebook (seen once in CI, in notebook 02). A socket file whose name no other process uses
cannot be taken, so the race is gone rather than retried.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile

import nbval.kernel
from jupyter_client.manager import KernelManager
from traitlets import default

# Short on purpose: a Unix socket's path may not exceed ~107 bytes.
_IPC_DIR = tempfile.mkdtemp(prefix="nbval-ipc-")
atexit.register(shutil.rmtree, _IPC_DIR, ignore_errors=True)
_kernel_numbers = itertools.count()


class IpcKernelManager(KernelManager):
    """A KernelManager whose kernel listens on `ipc://<private folder>/kernel-N-<channel>` sockets."""

    @default("transport")
    def _default_transport(self) -> str:
        return "ipc"

    @default("ip")
    def _default_ip(self) -> str:
        return os.path.join(_IPC_DIR, f"kernel-{next(_kernel_numbers)}")


nbval.kernel.KernelManager = IpcKernelManager
