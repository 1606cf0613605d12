"""CUDA unified memory (``um="offload"`` / ``um="all"``): the allocator, its routing and the CUDA
runtime binding. ``memory.py`` is the entry point."""
