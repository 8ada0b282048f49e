// The CUDA platform's typed-FFI handlers (execute stage), the same five targets and call frames as
// the CPU ones (ffi/handlers.h) plus XLA's stream.
#pragma once

extern "C" {
struct XLA_FFI_Error;
struct XLA_FFI_CallFrame;
XLA_FFI_Error* FlexlinkCudaAllReduce(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* FlexlinkCudaAllGather(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* FlexlinkCudaReduceScatter(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* FlexlinkCudaPpermute(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* FlexlinkCudaAllToAll(XLA_FFI_CallFrame* call_frame);
}
