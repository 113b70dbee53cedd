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
6. Better still, not at all: `python patch_horovod.py --record-probes` (docker/install.sh runs it
   after each install) asks each installed extension those build questions once, the same way
   horovodrun does, and writes the answers to horovod/build_probes.json. horovodrun then reads
   them instead of forking an import, as long as the extension libraries they were taken from are
   unchanged (same files, sizes and mtimes); anything else, and it probes as before. Runtime
   questions (is a GPU there?) are never recorded.
7. A torch rank waiting for a collective (WaitAndClear, at every synchronize) spun on
   sched_yield, so a rank that got ahead kept its core busy while the rank it waited for needed
   it: on a shared or oversubscribed CPU node (more ranks than cores, or other jobs) that is
   CPU taken from the work. It now spins for 100 us, then sleeps 50 us between polls.
8. The background loop negotiated with the other ranks every cycle (1 ms) even with nothing to
   reduce: an idle rank (loading data, validating, checkpointing, tracing) kept 10-20% of a
   core busy on Gloo messages. With no tensor waiting on this rank it now waits for one, up to
   20 ms, then negotiates; a tensor enqueued meanwhile ends the wait at once, and the cycle
   grid resumes, so tensors enqueued together are still negotiated together. Its symbols are
   hidden: a process may load both the torch and the TF extension, each linking this code.

Each edit must match exactly once; anything else means a different Horovod source and the
script exits non-zero rather than building something half-patched.
Usage: python patch_horovod.py HOROVOD_SRC_DIR     (before the build)
       python patch_horovod.py --record-probes       (after the install, in its Python)
"""

from __future__ import annotations

import glob
import json
import os
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
    (
        "horovod/common/util.py",
        "def _check_extension_lambda(ext_base_name, fn, fn_desc, verbose):\n"
        '    """\n'
        "    Tries to load the extension in a new process.  If successful, puts fn(ext)\n"
        '    to the queue or False otherwise.  Mutes all stdout/stderr.\n    """\n',
        "_NOT_RECORDED = object()\n\n\n"
        "def _recorded_probe(ext_base_name, fn_desc):\n"
        "    # ringfeed fix 6: build answers recorded at install (patch_horovod.py --record-probes),\n"
        "    # trusted only while the extension libraries they came from are unchanged\n"
        "    try:\n"
        "        pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))\n"
        "        with open(os.path.join(pkg, 'build_probes.json')) as f:\n"
        "            entry = json.load(f)[ext_base_name]\n"
        "        libs = sorted(glob.glob(os.path.join(pkg, ext_base_name, 'mpi_lib*')))\n"
        "        now = {os.path.basename(p): [os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in libs}\n"
        "        if now != entry['libs'] or fn_desc not in entry['answers']:\n"
        "            return _NOT_RECORDED\n"
        "        return entry['answers'][fn_desc]\n"
        "    except Exception:\n"
        "        return _NOT_RECORDED\n\n\n"
        "def _check_extension_lambda(ext_base_name, fn, fn_desc, verbose):\n"
        '    """\n'
        "    Tries to load the extension in a new process.  If successful, puts fn(ext)\n"
        '    to the queue or False otherwise.  Mutes all stdout/stderr.\n    """\n'
        "    recorded = _recorded_probe(ext_base_name, fn_desc)\n"
        "    if recorded is not _NOT_RECORDED:\n"
        "        return recorded\n",
    ),
    ("horovod/common/util.py", "import json\nimport multiprocessing\n",
     "import glob  # ringfeed fix 6\nimport json\nimport multiprocessing\n"),
    (
        "horovod/torch/mpi_ops_v2.cc",
        "void WaitAndClear(int handle) {\n"
        "  while (true) {\n"
        "    if (handle_manager.PollHandle(handle)) break;\n"
        "    {\n"
        "      py::gil_scoped_release release_python_gil;\n"
        "      std::this_thread::yield();\n"
        "    }\n"
        "  }\n",
        "void WaitAndClear(int handle) {\n"
        "  // ringfeed fix 7: spin briefly, then sleep between polls, so that a rank waiting for\n"
        "  // a slower one leaves it the core\n"
        "  auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);\n"
        "  while (true) {\n"
        "    if (handle_manager.PollHandle(handle)) break;\n"
        "    {\n"
        "      py::gil_scoped_release release_python_gil;\n"
        "      if (std::chrono::steady_clock::now() < spin_until) {\n"
        "        std::this_thread::yield();\n"
        "      } else {\n"
        "        std::this_thread::sleep_for(std::chrono::microseconds(50));\n"
        "      }\n"
        "    }\n"
        "  }\n",
    ),
    (
        "horovod/common/tensor_queue.h",
        "#include <iostream>\n#include <mutex>\n#include <queue>\n",
        "#include <chrono>  // ringfeed fix 8\n#include <condition_variable>\n"
        "#include <iostream>\n#include <mutex>\n#include <queue>\n\n"
        "#define HVD_FIX8_LOCAL __attribute__((visibility(\"hidden\")))\n",
    ),
    (
        "horovod/common/tensor_queue.h",
        "  void RemoveJoinTensor();\n\nprotected:\n",
        "  void RemoveJoinTensor();\n\n"
        "  // ringfeed fix 8: the background loop waits for work while no tensor is waiting.\n"
        "  // Hidden: the torch and TF extensions each link this code, and one process may load\n"
        "  // both; exported, one library's references bind to the other's condition variable\n"
        "  // and mutex and the two loops deadlock.\n"
        "  HVD_FIX8_LOCAL bool IsIdle() const;\n"
        "  HVD_FIX8_LOCAL static void ForgetWork();\n"
        "  HVD_FIX8_LOCAL static void WaitForWork(std::chrono::microseconds timeout);\n\n"
        "protected:\n"
        "  HVD_FIX8_LOCAL static void NotifyWork();\n"
        "  HVD_FIX8_LOCAL static std::mutex work_mutex_;\n"
        "  HVD_FIX8_LOCAL static std::condition_variable work_cv_;\n"
        "  HVD_FIX8_LOCAL static bool work_added_;\n\n",
    ),
    (
        "horovod/common/tensor_queue.cc",
        "namespace horovod {\nnamespace common {\n\n",
        "namespace horovod {\nnamespace common {\n\n"
        "// ringfeed fix 8: an idle background loop waits here for the next tensor\n"
        "std::mutex TensorQueue::work_mutex_;\n"
        "std::condition_variable TensorQueue::work_cv_;\n"
        "bool TensorQueue::work_added_ = false;\n\n"
        "void TensorQueue::NotifyWork() {\n"
        "  {\n"
        "    std::lock_guard<std::mutex> guard(work_mutex_);\n"
        "    work_added_ = true;\n"
        "  }\n"
        "  work_cv_.notify_all();\n"
        "}\n\n"
        "// Called before checking the queues: an enqueue after it ends the next wait at once\n"
        "void TensorQueue::ForgetWork() {\n"
        "  std::lock_guard<std::mutex> guard(work_mutex_);\n"
        "  work_added_ = false;\n"
        "}\n\n"
        "void TensorQueue::WaitForWork(std::chrono::microseconds timeout) {\n"
        "  std::unique_lock<std::mutex> lock(work_mutex_);\n"
        "  work_cv_.wait_for(lock, timeout, [] { return work_added_; });\n"
        "}\n\n"
        "bool TensorQueue::IsIdle() const {\n"
        "  std::lock_guard<std::mutex> guard(mutex_);\n"
        "  return tensor_table_.empty() && message_queue_.empty();\n"
        "}\n\n",
    ),
    (
        "horovod/common/tensor_queue.cc",
        "  tensor_table_.emplace(e.tensor_name, std::move(e));\n"
        "  message_queue_.push(std::move(message));\n"
        "  return Status::OK();\n",
        "  tensor_table_.emplace(e.tensor_name, std::move(e));\n"
        "  message_queue_.push(std::move(message));\n"
        "  NotifyWork();  // ringfeed fix 8\n"
        "  return Status::OK();\n",
    ),
    (
        "horovod/common/tensor_queue.cc",
        "    message_queue_.push(std::move(messages[i]));\n"
        "  }\n"
        "  return Status::OK();\n",
        "    message_queue_.push(std::move(messages[i]));\n"
        "  }\n"
        "  NotifyWork();  // ringfeed fix 8\n"
        "  return Status::OK();\n",
    ),
    (
        "horovod/common/operations.cc",
        "  if (sleep_duration > std::chrono::steady_clock::duration::zero()) {\n"
        "    std::this_thread::sleep_for(sleep_duration);\n"
        "  }\n"
        "  state.last_cycle_start = std::chrono::steady_clock::now();\n",
        "  // ringfeed fix 8: with no tensor waiting on this rank, wait for one (up to 20 ms)\n"
        "  // instead of negotiating every cycle, then go back on the cycle grid, so tensors\n"
        "  // enqueued together are still negotiated together. Also after a cycle that overran\n"
        "  // (it waited in a collective for an idle peer): the ranks then leave that collective\n"
        "  // together and wait in step. A tensor enqueued after ForgetWork ends the wait.\n"
        "  TensorQueue::ForgetWork();\n"
        "  bool idle = true;\n"
        "  for (auto id : state.process_set_table.Ids()) {\n"
        "    idle = idle && state.process_set_table.Get(id).tensor_queue.IsIdle();\n"
        "  }\n"
        "  if (idle) {\n"
        "    auto cycle = std::chrono::microseconds(\n"
        "        std::max(1L, long(state.parameter_manager.CycleTimeMs() * 1000.)));\n"
        "    TensorQueue::WaitForWork(std::chrono::milliseconds(20));\n"
        "    auto now = std::chrono::steady_clock::now();\n"
        "    auto cycles = now < state.last_cycle_start + cycle\n"
        "                      ? 1 : (now - state.last_cycle_start) / cycle + 1;\n"
        "    std::this_thread::sleep_until(state.last_cycle_start + cycles * cycle);\n"
        "  } else if (sleep_duration > std::chrono::steady_clock::duration::zero()) {\n"
        "    std::this_thread::sleep_for(sleep_duration);\n"
        "  }\n"
        "  state.last_cycle_start = std::chrono::steady_clock::now();\n",
    ),
]

# The build questions horovodrun asks an extension (util.py's fn_desc -> the call), fix 6.
PROBES = {
    "built": lambda ext: ext is not None,
    "built with MPI": lambda ext: ext.mpi_built(),
    "built with Gloo": lambda ext: ext.gloo_built(),
    "built with NCCL": lambda ext: ext.nccl_built(),
    "built with DDL": lambda ext: ext.ddl_built(),
    "built with CCL": lambda ext: ext.ccl_built(),
}
PROBED_EXTENSIONS = ("torch", "tensorflow")


def _answers(ext_name: str, queue) -> None:
    """What util._check_extension_lambda's forked child computes, for every question at once:
    the extension imported fresh, each answer fn(ext), None where it raises."""
    import importlib

    try:
        ext = importlib.import_module("." + ext_name, "horovod")
    except Exception:
        queue.put(dict.fromkeys(PROBES))
        return
    answers = {}
    for desc, fn in PROBES.items():
        try:
            answers[desc] = fn(ext)
        except Exception:
            answers[desc] = None
    queue.put(answers)


def library_stats(pkg: str, ext: str) -> dict[str, list[int]]:
    """{file name: [size, mtime_ns]} of an extension's libraries, as recorded; the patched
    util.py's _recorded_probe computes the same to decide whether a record still holds."""
    libs = sorted(glob.glob(os.path.join(pkg, ext, "mpi_lib*")))
    return {os.path.basename(p): [os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in libs}


def record_probes() -> int:
    """Ask each installed extension horovodrun's build questions, in a forked child as horovodrun
    does, and write the answers next to Horovod, atomically."""
    import multiprocessing

    import horovod

    pkg = os.path.dirname(os.path.abspath(horovod.__file__))
    out = os.path.join(pkg, "build_probes.json")
    if os.path.exists(out):
        os.remove(out)  # never record from a recording
    record = {}
    for ext in PROBED_EXTENSIONS:
        libs = library_stats(pkg, ext)
        if not libs:
            continue  # not built: horovodrun's own probe says so, cheaply
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_answers, args=(ext, queue))
        child.start()
        answers = queue.get(timeout=300)
        child.join()
        record[ext] = {"libs": libs, "answers": answers}
    with open(out + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(out + ".tmp", out)
    print(f"patch_horovod: recorded build probes of {', '.join(record) or 'no extension'} in {out}")
    return 0


def main(src: str) -> int:
    root = Path(src)
    for rel, old, new in EDITS:
        path = root / rel
        text = path.read_text()
        if text.count(new) == 1:
            continue  # already patched (checked first: some edits keep their old text inside)
        if text.count(old) != 1:
            print(f"patch_horovod: {rel}: expected text not found once; not Horovod 0.28.1?")
            return 1
        path.write_text(text.replace(old, new))
    return 0


if __name__ == "__main__":
    sys.exit(record_probes() if sys.argv[1:] == ["--record-probes"] else main(sys.argv[1]))
