// tallow: stand-in for a header the apache-tvm 0.27 wheel leaves out (see io.h here); the
// declarations tvm/runtime/tensor.h needs from it are in io.h.
#ifndef TALLOW_SHIM_TVM_SUPPORT_SERIALIZER_H_
#define TALLOW_SHIM_TVM_SUPPORT_SERIALIZER_H_
#include <tvm/support/io.h>
#endif  // TALLOW_SHIM_TVM_SUPPORT_SERIALIZER_H_
