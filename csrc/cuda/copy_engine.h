// Device-to-device copies of many byte ranges on a GPU's copy engines (DMA)
// instead of its SMs: one cuMemcpyBatchAsync where the driver has it (CUDA
// 12.8 or newer), else one cuMemcpyAsync per range. kv's gather and scatter
// use it (TORCH_IPC_KV_COPY=copy_engine, Note [kv copies]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/batched_copy.h"

namespace torch_ipc {

struct CopyRange {
  int64_t src;
  int64_t dst;
  int64_t bytes;
};

// The ranges that copy block ids[i] (found in `spans`) to the i-th
// block-sized row of the buffer at `rows` (into_rows) or back, a range that
// continues the one before it in both source and destination, within one
// span, merged into it. Every id is checked against the spans before any
// address is formed: an id outside them is an InvalidIndex.
std::vector<CopyRange> block_ranges(const int64_t* ids, size_t n, const std::vector<BlockSpan>& spans,
                                    int64_t block_bytes, int64_t rows, bool into_rows);

// How the ranges are handed to the driver.
enum class EngineCall : int {
  Batch = 0,     // one cuMemcpyBatchAsync (falls back to PerRange where the driver lacks it)
  PerRange = 1,  // one cuMemcpyAsync per range
};

// Whether the driver has cuMemcpyBatchAsync; `why_not` says why not. Throws
// CudaUnavailable without a usable driver.
bool memcpy_batch_available(std::string* why_not = nullptr);

// Queue the copies of `ranges` (device addresses on `device`, kept alive by
// the caller as for a kernel) on torch's current stream of `device`. With
// `prefer_overlap` the batch asks the driver to keep the copies off the SMs
// (CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE). Returns the call it made.
EngineCall copy_ranges_by_engine(int device, const std::vector<CopyRange>& ranges, EngineCall call,
                                 bool prefer_overlap);

// One strided copy as the copy engine takes it (Note [peer pieces on the copy
// engine] in torch_ipc/weights/_copy_engine.py): `height` rows of `width`
// bytes, row i at src + i * src_pitch, written at dst + i * dst_pitch.
struct Copy2D {
  int64_t src;
  int64_t dst;
  int64_t width;
  int64_t height;
  int64_t src_pitch;
  int64_t dst_pitch;
};

// Queue `copies` (device addresses, kept alive by the caller) on torch's
// current stream of `device`: one cuMemcpyAsync for a copy of one row or of
// rows that touch in both (pitch == width), one cuMemcpy2DAsync otherwise.
// Every copy is checked (positive sizes, width <= each pitch of a copy of
// several rows) before the first is queued: an InvalidValue otherwise.
void copy_2d_by_engine(int device, const std::vector<Copy2D>& copies);

}  // namespace torch_ipc
