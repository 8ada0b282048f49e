// The typed-FFI handlers (execute stage), one per collective; the dtype is dispatched inside.
// Declared with forward-declared C API types so that includers need not see XLA's headers.
#pragma once

extern "C" {
struct XLA_FFI_Error;
struct XLA_FFI_CallFrame;
XLA_FFI_Error* FlexlinkAllReduce(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* FlexlinkAllGather(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* FlexlinkReduceScatter(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* FlexlinkPpermute(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* FlexlinkAllToAll(XLA_FFI_CallFrame* call_frame);
}
