"""Apply ringfeed's source fixes to an unpacked Horovod 0.28.1 sdist (all of them, always: each is
harmless where it is not needed).

1. C++17 for the core and the torch extension (torch >= 2.1 headers need it; fixed upstream
   after 0.28.1 was released).
2. Drop horovod/tensorflow/xla_mpi_ops.cc from the TF build: it does not compile against the
   TF 2.21 headers (XLA client headers moved). XLA ops are optional and off by default.
3. GlooContext::InitializeForProcessSet ignores HOROVOD_GLOO_IFACE (uses its own, still empty,
   gloo_iface_), so multi-host Gloo runs fail wherever a hostname resolves to a loopback address.
4. GCC 13+ no longer pulls <string> and <stdexcept> in through other standard headers:
   group_table.h uses std::string and common.h std::logic_error without including them.
5. horovodrun asks a framework extension whether Horovod was built with Gloo/MPI, importing it in
   a forked process on every launch, TensorFlow first: 4-7 s of CPU per launch on a 2-core box.
   Every extension of one build gives the same answer, so torch (1.5-3 s) is asked first.

Each edit must match exactly once; anything else means a different Horovod source and the
script exits non-zero rather than building something half-patched.
Usage: python patch_horovod.py HOROVOD_SRC_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

EDITS: list[tuple[str, str, str]] = [
    ("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)\n", "set(CMAKE_CXX_STANDARD 17)\n"),
    (
        "horovod/torch/CMakeLists.txt",
        "    set(CMAKE_CXX_STANDARD 14)\n",
        "    set(CMAKE_CXX_STANDARD 17)\n",
    ),
    (
        "horovod/tensorflow/CMakeLists.txt",
        'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n',
        "# ringfeed: xla_mpi_ops.cc left out (does not compile against TF 2.21 headers)\n",
    ),
    (
        "horovod/common/gloo/gloo_context.cc",
        "  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
        "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;\n",
        "  attr device_attr;\n  gloo_iface_ = global_context.gloo_iface_;  // ringfeed fix\n"
        "  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
        "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;\n",
    ),
    (
        "horovod/common/group_table.h",
        "#include <queue>\n#include <unordered_map>\n",
        "#include <queue>\n#include <string>  // ringfeed: GCC 13\n#include <unordered_map>\n",
    ),
    (
        "horovod/common/common.h",
        "#include <memory>\n#include <string>\n",
        "#include <memory>\n#include <stdexcept>  // ringfeed: GCC 13\n#include <string>\n",
    ),
    (
        "horovod/common/util.py",
        "EXTENSIONS = ['tensorflow', 'torch', 'mxnet']\n",
        "EXTENSIONS = ['torch', 'tensorflow', 'mxnet']  # ringfeed: the cheaper import first\n",
    ),
]


def main(src: str) -> int:
    root = Path(src)
    for rel, old, new in EDITS:
        path = root / rel
        text = path.read_text()
        if text.count(old) != 1:
            if text.count(new) == 1:
                continue  # already patched
            print(f"patch_horovod: {rel}: expected text not found once; not Horovod 0.28.1?")
            return 1
        path.write_text(text.replace(old, new))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
