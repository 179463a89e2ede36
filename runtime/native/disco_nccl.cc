// tallow's NCCL collectives for TVM Disco (apache-tvm 0.27), written for tallow.
//
// Why it exists: the apache-tvm 0.27.0.post1 wheel has Disco but no collective library, so
// `Session.init_ccl("nccl", ...)` fails with "cannot find function runtime.disco.nccl.init_ccl".
// Disco finds a CCL only by global-function name: the controller calls
// `runtime.disco.<ccl>.init_ccl(session, device_ids)`, and once a worker's `DiscoWorker::ccl` is
// "nccl", every `runtime.disco.allreduce` (what a tensor-parallel library calls after o_proj and
// down_proj), broadcast, scatter, gather and send/recv a worker runs becomes a call to
// `runtime.disco.nccl.<name>`. This file registers those names on top of PyPI's NCCL
// (nvidia-nccl-cu13) and the CUDA runtime, using only the headers the wheels ship.
//
// Built by `tallow build-nccl` (runtime/nccl_module.py); loaded by runtime/disco_runtime.py in the
// controller and in every ProcessSession worker (runtime/tp_worker.py).
//
// Error policy: a C++ exception thrown in a Disco worker ends that worker (std::terminate), so
// everything that can be checked is checked on the controller, in `init_ccl`, where it becomes a
// Python exception: a CUDA runtime that finds no driver or too few devices is refused there.

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/ffi/string.h>
#include <tvm/runtime/disco/builtin.h>
#include <tvm/runtime/disco/disco_worker.h>
#include <tvm/runtime/disco/session.h>
#include <tvm/runtime/tensor.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace tallow_nccl {

using tvm::ffi::Optional;
using tvm::ffi::Shape;
using tvm::runtime::DiscoWorker;
using tvm::runtime::DRef;
using tvm::runtime::Session;
using tvm::runtime::Tensor;

#define TALLOW_PREFIX "runtime.disco.nccl."

void CheckNccl(ncclResult_t result, const char* call) {
  if (result != ncclSuccess) {
    const char* detail = ncclGetLastError(nullptr);
    TVM_FFI_THROW(RuntimeError) << "NCCL " << call << " failed: " << ncclGetErrorString(result)
                                << (detail && *detail ? std::string(" (") + detail + ")" : "");
  }
}

void CheckCuda(cudaError_t error, const char* call) {
  if (error != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << "CUDA " << call << " failed: " << cudaGetErrorString(error);
  }
}

// One worker's NCCL state. Disco runs each worker on its own thread (ThreadedSession) or in its
// own process (ProcessSession), so thread-local storage holds exactly one worker's state.
struct WorkerState {
  DiscoWorker* worker = nullptr;
  int device = -1;
  cudaStream_t stream = nullptr;
  ncclComm_t world = nullptr;  // all workers
  ncclComm_t group = nullptr;  // this worker's group (== world with one group)

  ~WorkerState() {
    // At thread exit: errors cannot be reported any more, so they are ignored.
    if (group != nullptr && group != world) ncclCommDestroy(group);
    if (world != nullptr) ncclCommDestroy(world);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  int group_size() const { return worker->num_workers / worker->num_groups; }
  ncclComm_t comm(bool in_group) const { return in_group ? group : world; }
  // Is this worker the root of the communicator (worker 0, or the first of its group)?
  bool is_root(bool in_group) const {
    return in_group ? worker->worker_id % group_size() == 0 : worker->worker_id == 0;
  }

  // The stream TVM's CUDA runtime is using on this thread when it has one set; else ours.
  // Ours is created with cudaStreamCreate (a blocking stream), so it orders itself after the
  // kernels TVM launched on the legacy default stream and before the ones that follow.
  cudaStream_t current_stream() const {
    static const auto get = tvm::ffi::Function::GetGlobal("runtime.get_cuda_stream");
    if (get.has_value()) {
      void* s = (*get)().cast<void*>();
      if (s != nullptr) return static_cast<cudaStream_t>(s);
    }
    return stream;
  }
};

WorkerState& State() {
  thread_local WorkerState state;
  return state;
}

WorkerState& Ready() {
  WorkerState& s = State();
  TVM_FFI_CHECK(s.world != nullptr, RuntimeError)
      << "NCCL is not initialised on this Disco worker: call session.init_ccl(\"nccl\", ...) first";
  return s;
}

ncclDataType_t NcclType(DLDataType t) {
  if (t.lanes != 1) TVM_FFI_THROW(ValueError) << "NCCL cannot move vector dtype lanes=" << t.lanes;
  switch (t.code) {
    case kDLInt:
      if (t.bits == 8) return ncclInt8;
      if (t.bits == 32) return ncclInt32;
      if (t.bits == 64) return ncclInt64;
      break;
    case kDLUInt:
      if (t.bits == 8) return ncclUint8;
      if (t.bits == 32) return ncclUint32;
      if (t.bits == 64) return ncclUint64;
      break;
    case kDLFloat:
      if (t.bits == 16) return ncclFloat16;
      if (t.bits == 32) return ncclFloat32;
      if (t.bits == 64) return ncclFloat64;
      break;
    case kDLBfloat:
      if (t.bits == 16) return ncclBfloat16;
      break;
    case kDLFloat8_e4m3fn:
    case kDLFloat8_e5m2:
      return ncclUint8;  // moved as bytes; all-reduce refuses them (a byte sum is not an fp8 sum)
    default:
      break;
  }
  TVM_FFI_THROW(ValueError) << "NCCL has no type for DLPack dtype code " << int(t.code) << " bits "
                            << int(t.bits);
}

void* Data(const Tensor& t) {
  TVM_FFI_CHECK(t.IsContiguous(), ValueError) << "NCCL needs contiguous tensors";
  return static_cast<char*>(t->data) + t->byte_offset;
}

size_t Count(const Tensor& t) { return static_cast<size_t>(t.numel()); }

// ---- controller side ----------------------------------------------------------------------

// `session.init_ccl("nccl", *device_ids)`: checks the devices here, where a failure is a Python
// exception, then hands every worker the same NCCL unique id.
void InitCCL(Session session, Shape device_ids) {
  int64_t workers = session->GetNumWorkers();
  TVM_FFI_CHECK(static_cast<int64_t>(device_ids.size()) >= 1, ValueError)
      << "init_ccl(\"nccl\") needs one CUDA device id per worker";
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    TVM_FFI_THROW(RuntimeError) << "NCCL tensor parallelism needs CUDA GPUs, and this machine has "
                                << "none usable: "
                                << (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
  }
  // Disco allocates each worker's tensors through TVM's CUDA device API; runtime-only TVM
  // keeps it in libtvm_runtime_cuda.so. Missing, the first allocation on a worker thread would
  // abort the process (seen on an H100): say so here, where it is a Python exception.
  TVM_FFI_CHECK(tvm::ffi::Function::GetGlobal("device_api.cuda").has_value(), RuntimeError)
      << "TVM's CUDA device API is not loaded (libtvm_runtime_cuda.so): load it before "
      << "init_ccl (tallow's nccl_module.load does)";
  for (int64_t id : device_ids) {
    TVM_FFI_CHECK(id >= 0 && id < count, ValueError)
        << "CUDA device " << id << " does not exist: this machine has " << count << " GPU(s)";
  }
  TVM_FFI_CHECK(static_cast<int64_t>(device_ids.size()) <= workers || workers == 0, ValueError)
      << device_ids.size() << " device ids for " << workers << " workers";
  ncclUniqueId id;
  CheckNccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  DRef per_worker = session->GetGlobalFunc(TALLOW_PREFIX "init_ccl_per_worker");
  session->CallPacked(per_worker, device_ids,
                      tvm::ffi::Bytes(id.internal, sizeof(id.internal)));
}

// ---- worker side --------------------------------------------------------------------------

void InitPerWorker(Shape device_ids, tvm::ffi::Bytes unique_id) {
  WorkerState& s = State();
  DiscoWorker* worker = DiscoWorker::ThreadLocal();
  TVM_FFI_CHECK(worker != nullptr, RuntimeError) << "init_ccl_per_worker runs on Disco workers";
  TVM_FFI_CHECK(s.world == nullptr, RuntimeError) << "NCCL is already initialised on this worker";
  TVM_FFI_CHECK(unique_id.size() == sizeof(ncclUniqueId), ValueError)
      << "an NCCL unique id has " << sizeof(ncclUniqueId) << " bytes, not " << unique_id.size();
  TVM_FFI_CHECK(worker->local_worker_id < static_cast<int>(device_ids.size()), ValueError)
      << "no device id for local worker " << worker->local_worker_id;
  int device = static_cast<int>(device_ids[worker->local_worker_id]);
  DLDevice cuda{kDLCUDA, device};
  if (worker->default_device.device_type != kDLCPU) {
    TVM_FFI_CHECK(worker->default_device.device_type == kDLCUDA &&
                      worker->default_device.device_id == device,
                  ValueError)
        << "the worker's default device is not cuda:" << device;
  }
  CheckCuda(cudaSetDevice(device), "cudaSetDevice");
  CheckCuda(cudaStreamCreate(&s.stream), "cudaStreamCreate");
  worker->default_device = cuda;  // where runtime.disco.empty and load_vm_module allocate
  worker->ccl = "nccl";           // builtins now dispatch to runtime.disco.nccl.*
  s.worker = worker;
  s.device = device;
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  CheckNccl(ncclCommInitRank(&s.world, worker->num_workers, id, worker->worker_id),
            "ncclCommInitRank");
  if (worker->num_groups == 1) {
    s.group = s.world;
  } else {
    int g = s.group_size();
    CheckNccl(ncclCommSplit(s.world, worker->worker_id / g, worker->worker_id % g, &s.group,
                            nullptr),
              "ncclCommSplit");
  }
}

ncclRedOp_t NcclOp(int kind) {
  // tvm::runtime::ReduceKind: kSum, kProd, kMin, kMax, kAvg (builtin.h)
  switch (static_cast<tvm::runtime::ReduceKind>(kind)) {
    case tvm::runtime::ReduceKind::kSum:
      return ncclSum;
    case tvm::runtime::ReduceKind::kProd:
      return ncclProd;
    case tvm::runtime::ReduceKind::kMin:
      return ncclMin;
    case tvm::runtime::ReduceKind::kMax:
      return ncclMax;
    case tvm::runtime::ReduceKind::kAvg:
      return ncclAvg;
  }
  TVM_FFI_THROW(ValueError) << "unknown reduce kind " << kind;
}

void AllReduce(Tensor send, int kind, bool in_group, Tensor recv) {
  WorkerState& s = Ready();
  DLDataType t = send.DataType();
  TVM_FFI_CHECK(t.code != kDLFloat8_e4m3fn && t.code != kDLFloat8_e5m2, ValueError)
      << "NCCL cannot all-reduce float8";
  TVM_FFI_CHECK(Count(send) == Count(recv), ValueError) << "all-reduce of unequal sizes";
  CheckNccl(ncclAllReduce(Data(send), Data(recv), Count(send), NcclType(t), NcclOp(kind),
                          s.comm(in_group), s.current_stream()),
            "ncclAllReduce");
}

void AllGather(Tensor send, bool in_group, Tensor recv) {
  WorkerState& s = Ready();
  int ranks = in_group ? s.group_size() : s.worker->num_workers;
  TVM_FFI_CHECK(Count(recv) == Count(send) * ranks, ValueError)
      << "all-gather: recv holds " << Count(recv) << " elements, not " << ranks << " x "
      << Count(send);
  CheckNccl(ncclAllGather(Data(send), Data(recv), Count(send), NcclType(send.DataType()),
                          s.comm(in_group), s.current_stream()),
            "ncclAllGather");
}

void Broadcast(Optional<Tensor> send, bool in_group, Tensor recv) {
  WorkerState& s = Ready();
  const void* from = nullptr;
  if (s.is_root(in_group)) {
    TVM_FFI_CHECK(send.has_value(), ValueError) << "the broadcasting worker needs a send buffer";
    TVM_FFI_CHECK(Count(*send) == Count(recv), ValueError) << "broadcast of unequal sizes";
    from = Data(*send);
  }
  CheckNccl(ncclBroadcast(from, Data(recv), Count(recv), NcclType(recv.DataType()), 0,
                          s.comm(in_group), s.current_stream()),
            "ncclBroadcast");
}

// Scatter and gather as grouped point-to-point calls: the root sends (or receives) one equal
// slice per rank of the communicator, itself included.
void Scatter(Optional<Tensor> send, bool in_group, Tensor recv) {
  WorkerState& s = Ready();
  int ranks = in_group ? s.group_size() : s.worker->num_workers;
  ncclComm_t comm = s.comm(in_group);
  cudaStream_t stream = s.current_stream();
  ncclDataType_t type = NcclType(recv.DataType());
  CheckNccl(ncclGroupStart(), "ncclGroupStart");
  if (s.is_root(in_group)) {
    TVM_FFI_CHECK(send.has_value(), ValueError) << "the scattering worker needs a send buffer";
    TVM_FFI_CHECK(Count(*send) == Count(recv) * ranks, ValueError)
        << "scatter: send holds " << Count(*send) << " elements, not " << ranks << " x "
        << Count(recv);
    size_t bytes = tvm::ffi::GetDataSize(Count(recv), recv.DataType());
    char* base = static_cast<char*>(Data(*send));
    for (int r = 0; r < ranks; ++r) {
      CheckNccl(ncclSend(base + r * bytes, Count(recv), type, r, comm, stream), "ncclSend");
    }
  }
  CheckNccl(ncclRecv(Data(recv), Count(recv), type, 0, comm, stream), "ncclRecv");
  CheckNccl(ncclGroupEnd(), "ncclGroupEnd");
}

void Gather(Tensor send, bool in_group, Optional<Tensor> recv) {
  WorkerState& s = Ready();
  int ranks = in_group ? s.group_size() : s.worker->num_workers;
  ncclComm_t comm = s.comm(in_group);
  cudaStream_t stream = s.current_stream();
  ncclDataType_t type = NcclType(send.DataType());
  CheckNccl(ncclGroupStart(), "ncclGroupStart");
  if (s.is_root(in_group)) {
    TVM_FFI_CHECK(recv.has_value(), ValueError) << "the gathering worker needs a recv buffer";
    TVM_FFI_CHECK(Count(*recv) == Count(send) * ranks, ValueError)
        << "gather: recv holds " << Count(*recv) << " elements, not " << ranks << " x "
        << Count(send);
    size_t bytes = tvm::ffi::GetDataSize(Count(send), send.DataType());
    char* base = static_cast<char*>(Data(*recv));
    for (int r = 0; r < ranks; ++r) {
      CheckNccl(ncclRecv(base + r * bytes, Count(send), type, r, comm, stream), "ncclRecv");
    }
  }
  CheckNccl(ncclSend(Data(send), Count(send), type, 0, comm, stream), "ncclSend");
  CheckNccl(ncclGroupEnd(), "ncclGroupEnd");
}

// Point-to-point over the world communicator; `peer` is a worker id.
void SendTo(const Tensor& buffer, int peer) {
  WorkerState& s = Ready();
  TVM_FFI_CHECK(peer >= 0 && peer < s.worker->num_workers && peer != s.worker->worker_id,
                ValueError)
      << "worker " << s.worker->worker_id << " cannot send to worker " << peer;
  CheckNccl(ncclSend(Data(buffer), Count(buffer), NcclType(buffer.DataType()), peer, s.world,
                     s.current_stream()),
            "ncclSend");
}

void RecvFrom(const Tensor& buffer, int peer) {
  WorkerState& s = Ready();
  TVM_FFI_CHECK(peer >= 0 && peer < s.worker->num_workers && peer != s.worker->worker_id,
                ValueError)
      << "worker " << s.worker->worker_id << " cannot receive from worker " << peer;
  CheckNccl(ncclRecv(Data(buffer), Count(buffer), NcclType(buffer.DataType()), peer, s.world,
                     s.current_stream()),
            "ncclRecv");
}

void SyncWorker() {
  WorkerState& s = Ready();
  CheckCuda(cudaStreamSynchronize(s.current_stream()), "cudaStreamSynchronize");
}

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def(TALLOW_PREFIX "init_ccl", InitCCL)
      .def(TALLOW_PREFIX "init_ccl_per_worker", InitPerWorker)
      .def(TALLOW_PREFIX "allreduce", AllReduce)
      .def(TALLOW_PREFIX "allgather", AllGather)
      .def(TALLOW_PREFIX "broadcast_from_worker0", Broadcast)
      .def(TALLOW_PREFIX "scatter_from_worker0", Scatter)
      .def(TALLOW_PREFIX "gather_to_worker0", Gather)
      .def(TALLOW_PREFIX "recv_from_worker0",
           [](Tensor buffer) { RecvFrom(buffer, 0); })
      .def(TALLOW_PREFIX "send_to_next_group",
           [](Tensor buffer) {
             WorkerState& s = Ready();
             SendTo(buffer, s.worker->worker_id + s.group_size());
           })
      .def(TALLOW_PREFIX "recv_from_prev_group",
           [](Tensor buffer) {
             WorkerState& s = Ready();
             RecvFrom(buffer, s.worker->worker_id - s.group_size());
           })
      .def(TALLOW_PREFIX "send_to_worker", [](Tensor buffer, int peer) { SendTo(buffer, peer); })
      .def(TALLOW_PREFIX "recv_from_worker",
           [](Tensor buffer, int peer) { RecvFrom(buffer, peer); })
      .def(TALLOW_PREFIX "sync_worker", SyncWorker)
      // which library this is, for `tallow build-nccl` and the tests
      .def("tallow.nccl.version", []() -> int64_t {
        int v = 0;
        CheckNccl(ncclGetVersion(&v), "ncclGetVersion");
        return v;
      });
}

}  // namespace tallow_nccl
