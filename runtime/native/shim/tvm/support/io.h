// tallow: stand-in for a header the apache-tvm 0.27 wheel leaves out of its include/ folder.
//
// The wheel's tvm/runtime/tensor.h (which tvm/runtime/disco/session.h includes) names
// tvm::support::Stream in inline save/load helpers, but the wheel ships no tvm/support/ headers.
// tallow's NCCL module never serialises a tensor, so these declarations exist only so that
// tensor.h parses: nothing here is defined or called, and a Stream is only ever passed by pointer
// there, so no object layout depends on it.
#ifndef TALLOW_SHIM_TVM_SUPPORT_IO_H_
#define TALLOW_SHIM_TVM_SUPPORT_IO_H_

#include <cstddef>

namespace tvm {
namespace support {

class Stream {
 public:
  virtual ~Stream() = default;
  virtual size_t Read(void* ptr, size_t size) = 0;
  virtual size_t Write(const void* ptr, size_t size) = 0;
  template <typename T>
  void Write(const T& value);
  template <typename T>
  bool Read(T* value);
  template <typename T>
  void WriteArray(const T* values, size_t count);
  template <typename T>
  bool ReadArray(T* values, size_t count);
};

}  // namespace support
}  // namespace tvm

#endif  // TALLOW_SHIM_TVM_SUPPORT_IO_H_
