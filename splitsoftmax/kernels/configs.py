"""Every tile size and launch configuration, as data in one place."""

# Torch (CPU) path: columns per block of a softmax row, keys per block of attention.
CPU_BLOCK_COLS = 8192
CPU_BLOCK_KEYS = 256
