"""The descriptor pool of gpuserve's generated protobuf modules.

Not protobuf's default pool: ``tritonclient.grpc`` (and other V2 clients) register their own
compiled copy of the ``inference`` package there, and a second, different file defining the
same message names would fail to import in a process that has both (a test process, or an
application embedding gpuserve next to a client). On the wire the two are the same messages.
"""

from __future__ import annotations

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
