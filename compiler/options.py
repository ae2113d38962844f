"""The values `compiler build` accepts and its defaults (no TVM here: the CLI answers --help and bad options fast)."""

TARGETS = ("llvm", "cuda")
MATMUL_PRECISIONS = ("float32", "bfloat16", "auto")
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
COMPILERS = ("ptx", "nvrtc", "nvcc")
COMPILER_ENV, PTX_VERSION_ENV = "RUDA_CUDA_COMPILER", "RUDA_PTX_VERSION"
DEFAULT_PREFILL_BUCKETS = (16, 64, 256)
DEFAULT_MAX_CONTEXT = 4096  # tokens one sequence may hold, capped at the model's max_position_embeddings
DEFAULT_BATCH_ROWS = (1,)
DEFAULT_IMAGE_PATCH_BUCKETS = (256, 1024, 4096)  # patches per vision-encoder call (4096: a 1024x1024 image at 16 px)
