"""Builds the native extensions: ``fastcomm._C`` from ``csrc/comm`` and ``fastio._C`` from ``csrc/io``.

Environment switches:
  FASTCOMM_NO_NATIVE=1  skip ``fastcomm._C`` (the package then runs its plain-PyTorch reference ops)
  FASTIO_NO_NATIVE=1    skip ``fastio._C`` (the loader then gathers with torch ops)
  FASTCOMM_NO_CUDA=1    build CPU kernels only even when the installed torch has CUDA
  FASTLIB_DEBUG_INFO=1  compile with debug info (-g), for a debugger in the kernels
  MAX_JOBS              parallel compile jobs (torch's own switch)
"""

import glob
import os

from setuptools import setup

_HERE = os.path.dirname(os.path.abspath(__file__))

# (python package, source folder, switch that skips it)
_NATIVE = (
    ("fastcomm", "csrc/comm", "FASTCOMM_NO_NATIVE"),
    ("fastio", "csrc/io", "FASTIO_NO_NATIVE"),
)


def _native_extensions():
    wanted = [spec for spec in _NATIVE if os.environ.get(spec[2], "0") != "1"]
    if not wanted:
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    with_cuda = (
        torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("FASTCOMM_NO_CUDA") != "1"
    )
    # torch picks the C++ standard its headers need; -ffp-contract=off keeps x*inv+c two roundings, as
    # in the reference twins (no fused multiply-add). -g0 undoes the -g of Python's own CFLAGS: debug info for
    # torch's templates cost a quarter of the compile time (the build is part of `make test`'s install);
    # FASTLIB_DEBUG_INFO=1 keeps it.
    cxx_flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    if os.environ.get("FASTLIB_DEBUG_INFO") != "1":
        cxx_flags.append("-g0")
    extensions = []
    for package, folder, _ in wanted:
        cpp = sorted(glob.glob(os.path.join(folder, "*.cpp"))) + sorted(glob.glob("csrc/common/*.cpp"))
        cu = sorted(glob.glob(os.path.join(folder, "*.cu"))) if with_cuda else []
        if not cpp:
            continue
        common = dict(
            name=f"{package}._C",
            include_dirs=[os.path.join(_HERE, "csrc")],
            extra_link_args=["-fopenmp"],
        )
        if cu:
            extensions.append(
                CUDAExtension(
                    sources=cpp + cu,
                    define_macros=[("FASTLIB_WITH_CUDA", "1")],
                    extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--fmad=false"]},
                    **common,
                )
            )
        else:
            extensions.append(CppExtension(sources=cpp, extra_compile_args={"cxx": cxx_flags}, **common))
    return extensions, {"build_ext": _side_by_side(BuildExtension).with_options(use_ninja=True)}


def _side_by_side(base: type) -> type:
    """torch's ``BuildExtension`` building the extensions at once (setuptools' ``parallel``), each compiling in
    a build folder of its own: ninja's file is one per folder, and the first extension's build would otherwise
    keep the second's waiting (a quarter of the build's wall time on 2 cores)."""

    class SideBySide(base):
        def finalize_options(self) -> None:
            super().finalize_options()
            self.parallel = self.parallel or len(self.extensions)

        def build_extension(self, ext) -> None:
            # torch has put its ninja compile in place by now; a build folder per source folder (comm, io)
            compile_objects = self.compiler.compile
            if not getattr(compile_objects, "per_folder", False):

                def per_folder(sources, output_dir=None, *args, **kwargs):
                    folder = os.path.basename(os.path.dirname(os.path.abspath(sources[0])))
                    return compile_objects(sources, os.path.join(output_dir or "", folder), *args, **kwargs)

                per_folder.per_folder = True
                self.compiler.compile = per_folder
            super().build_extension(ext)

    return SideBySide


ext_modules, cmdclass = _native_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
