"""Client shared memory: system (POSIX) and CUDA regions a client registers, and CUDA IPC."""
