"""The kernels' CUDA sources and the PTX that build.py compiles from them. A package only so that
the PTX ships as its data in the wheel (runtime.kernel.shipped_ptx_dir finds it)."""
