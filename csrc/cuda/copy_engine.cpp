#include "cuda/copy_engine.h"

#include <c10/util/Exception.h>

#include "base/errors.h"

#include "cuda/cuda_context.h"
#include "cuda/cuda_driver.h"

namespace torch_ipc {
namespace {

// Whether `next` starts where `last` ends, in both source and destination.
bool continues(const CopyRange& last, const CopyRange& next) {
  return last.src + last.bytes == next.src && last.dst + last.bytes == next.dst;
}

// Note [batch copies off the legacy stream]
// cuMemcpyBatchAsync refuses the legacy default stream (CUDA_ERROR_INVALID_VALUE),
// and that is torch's current stream unless the caller picked another. A batch
// on a non-blocking stream of ours, ordered both ways with events, made the
// host wait for the current stream (2 x H100, driver 580, 2026-11-26: the
// ordering test of tests/kv/test_kv_copy_engine.py found the stream idle after
// the calls). So on the legacy stream the copies go one cuMemcpyAsync per range,
// which that test found ordered and asynchronous there; torch_ipc/kv/_copies.py
// says so in pool.copy_path.
bool is_special_stream(CUstream stream) {
  return stream == nullptr || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD;
}

void copy_per_range(CUstream stream, const std::vector<CopyRange>& ranges) {
  for (const CopyRange& r : ranges)
    TORCH_IPC_CU(cuMemcpyAsync, static_cast<CUdeviceptr>(r.dst), static_cast<CUdeviceptr>(r.src),
                 static_cast<size_t>(r.bytes), stream);
}

// One cuMemcpyBatchAsync of `ranges` on `stream` (not a special stream).
void copy_batch(MemcpyBatchAsync batch, CUstream stream, const std::vector<CopyRange>& ranges, bool prefer_overlap) {
  std::vector<CUdeviceptr> dsts, srcs;
  std::vector<size_t> sizes;
  for (const CopyRange& r : ranges) {
    dsts.push_back(static_cast<CUdeviceptr>(r.dst));
    srcs.push_back(static_cast<CUdeviceptr>(r.src));
    sizes.push_back(static_cast<size_t>(r.bytes));
  }
  MemcpyAttributes attrs{};  // location hints unset: they serve managed memory only
  attrs.src_access_order = kMemcpySrcAccessOrderStream;
  attrs.flags = prefer_overlap ? kMemcpyPreferOverlapWithCompute : 0u;
  size_t first_with_attrs = 0;
  size_t failed = ranges.size();
  CUresult r =
      batch(dsts.data(), srcs.data(), sizes.data(), ranges.size(), &attrs, &first_with_attrs, 1, &failed, stream);
  if (r != CUDA_SUCCESS)
    throw_driver_error("cuMemcpyBatchAsync", r,
                       "torch_ipc: a batch of " + std::to_string(ranges.size()) + " copies (copy " +
                           std::to_string(failed) + " failed)");
}

}  // namespace

std::vector<CopyRange> block_ranges(const int64_t* ids, size_t n, const std::vector<BlockSpan>& spans,
                                    int64_t block_bytes, int64_t rows, bool into_rows) {
  TORCH_IPC_CHECK_VALUE(block_bytes > 0, "torch_ipc: copy ranges for blocks of ", block_bytes, " bytes");
  std::vector<size_t> where(n);
  for (size_t i = 0; i < n; ++i) where[i] = block_span(spans, ids[i]);  // before any address is formed
  std::vector<CopyRange> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const BlockSpan& span = spans[where[i]];
    const int64_t block = span.base + (ids[i] - span.first) * block_bytes;
    const int64_t row = rows + static_cast<int64_t>(i) * block_bytes;
    const CopyRange next{into_rows ? block : row, into_rows ? row : block, block_bytes};
    if (i > 0 && where[i] == where[i - 1] && continues(out.back(), next))
      out.back().bytes += block_bytes;  // one allocation: a single copy may cross the blocks
    else
      out.push_back(next);
  }
  return out;
}

bool memcpy_batch_available(std::string* why_not) {
  const DriverApi& d = driver();
  if (why_not) *why_not = d.cuMemcpyBatchAsync_missing;
  return d.cuMemcpyBatchAsync != nullptr;
}

EngineCall copy_ranges_by_engine(int device, const std::vector<CopyRange>& ranges, EngineCall call,
                                 bool prefer_overlap) {
  TORCH_IPC_CHECK_VALUE(call == EngineCall::Batch || call == EngineCall::PerRange,
                        "torch_ipc: unknown copy engine call ", static_cast<int>(call));
  const DriverApi& d = driver();
  if (d.cuMemcpyBatchAsync == nullptr) call = EngineCall::PerRange;
  if (ranges.empty()) return call;
  ScopedContext scope(device);
  CUstream current = current_stream(device);
  if (is_special_stream(current)) call = EngineCall::PerRange;  // Note [batch copies off the legacy stream]
  if (call == EngineCall::PerRange)
    copy_per_range(current, ranges);
  else
    copy_batch(d.cuMemcpyBatchAsync, current, ranges, prefer_overlap);
  return call;
}

namespace {

void check_2d(const Copy2D& c) {
  TORCH_IPC_CHECK_VALUE(c.width > 0 && c.height > 0 && c.src != 0 && c.dst != 0, "torch_ipc: a 2-D copy of ", c.height,
                        " rows of ", c.width, " bytes");
  TORCH_IPC_CHECK_VALUE(c.height == 1 || (c.src_pitch >= c.width && c.dst_pitch >= c.width),
                        "torch_ipc: a 2-D copy of rows of ", c.width, " bytes with pitches ", c.src_pitch, " and ",
                        c.dst_pitch);
}

bool one_range(const Copy2D& c) { return c.height == 1 || (c.src_pitch == c.width && c.dst_pitch == c.width); }

}  // namespace

void copy_2d_by_engine(int device, const std::vector<Copy2D>& copies) {
  for (const Copy2D& c : copies) check_2d(c);  // before anything is queued
  if (copies.empty()) return;
  ScopedContext scope(device);
  CUstream stream = current_stream(device);
  for (const Copy2D& c : copies) {
    if (one_range(c)) {
      TORCH_IPC_CU(cuMemcpyAsync, static_cast<CUdeviceptr>(c.dst), static_cast<CUdeviceptr>(c.src),
                   static_cast<size_t>(c.width * c.height), stream);
      continue;
    }
    CUDA_MEMCPY2D m{};
    m.srcMemoryType = CU_MEMORYTYPE_DEVICE;
    m.srcDevice = static_cast<CUdeviceptr>(c.src);
    m.srcPitch = static_cast<size_t>(c.src_pitch);
    m.dstMemoryType = CU_MEMORYTYPE_DEVICE;
    m.dstDevice = static_cast<CUdeviceptr>(c.dst);
    m.dstPitch = static_cast<size_t>(c.dst_pitch);
    m.WidthInBytes = static_cast<size_t>(c.width);
    m.Height = static_cast<size_t>(c.height);
    TORCH_IPC_CU(cuMemcpy2DAsync, &m, stream);
  }
}

}  // namespace torch_ipc
