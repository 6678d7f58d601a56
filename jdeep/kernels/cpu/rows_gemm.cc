// jdeep's CPU kernel for products with few rows: y[M, N] = x[M, K] · W[N, K]ᵀ, W read in place from a stack.
//
// XLA:CPU runs a product of one row as a matrix-vector loop at memory bandwidth, but 2 to 16 rows go through its
// GEMM path at a fifth of it, after copying a weight sliced out of a stacked array (docs/performance.md, Findings 1
// and 6). Here every weight row is read once from where it lies and multiplied against all M rows of x, which stay
// in L1 (M x K fp32); the weight rows are split over XLA's intra-op thread pool in blocks.
//
// Operands: x f32[M, K]; w f32 or bf16 [*S, N, K] (a stack of matrices, S any leading dims, maybe none);
// index s32[len(S)] (which matrix; each entry clamped into range as XLA's dynamic-slice clamps). Result f32[M, N].
// Each output is one fixed-order sum over K (16 lanes, then the lanes in order), whatever the thread count, so
// results are deterministic; they differ from XLA's own dot in the order of the fp32 sum only.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline v16 load(const uint16_t* p) {  // 16 bf16 values -> fp32 (exact: the bf16 bits are the fp32's high half)
  v16h h;
  std::memcpy(&h, p, sizeof h);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  v16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline float scalar(float v) { return v; }
inline float scalar(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline float lanes_sum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// Weight rows [n0, n1) against M rows of x, two weight rows at a time (2M accumulators in registers).
template <int M, typename W>
void rows(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t K16 = K & ~int64_t(15);
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    v16 acc0[M], acc1[M];
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = v16{};
    const W* w0 = w + n * K;
    const W* w1 = w0 + K;
    for (int64_t k = 0; k < K16; k += 16) {
      const v16 a = load(w0 + k), b = load(w1 + k);
      for (int m = 0; m < M; ++m) {
        const v16 xv = load(x + m * K + k);
        acc0[m] += xv * a;
        acc1[m] += xv * b;
      }
    }
    for (int m = 0; m < M; ++m) {
      float s0 = lanes_sum(acc0[m]), s1 = lanes_sum(acc1[m]);
      for (int64_t k = K16; k < K; ++k) {
        s0 += x[m * K + k] * scalar(w0[k]);
        s1 += x[m * K + k] * scalar(w1[k]);
      }
      y[m * N + n] = s0;
      y[m * N + n + 1] = s1;
    }
  }
  for (; n < n1; ++n) {
    v16 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = v16{};
    const W* w0 = w + n * K;
    for (int64_t k = 0; k < K16; k += 16) {
      const v16 a = load(w0 + k);
      for (int m = 0; m < M; ++m) acc[m] += load(x + m * K + k) * a;
    }
    for (int m = 0; m < M; ++m) {
      float s = lanes_sum(acc[m]);
      for (int64_t k = K16; k < K; ++k) s += x[m * K + k] * scalar(w0[k]);
      y[m * N + n] = s;
    }
  }
}

constexpr int kMaxRows = 16;  // rows per pass over W; more rows take several passes

template <typename W>
using RowsFn = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t);

template <typename W, int... Ms>
constexpr RowsFn<W> pick(int m, std::integer_sequence<int, Ms...>) {
  constexpr RowsFn<W> fns[] = {rows<Ms + 1, W>...};
  return fns[m - 1];
}

// The weight-row blocks of one call, shared by the calling thread and the pool's tasks. A task that starts after
// every block is taken returns at once; the shared_ptr keeps this alive for it.
template <typename W>
struct Work {
  const float* x;
  const W* w;
  float* y;
  int64_t M, K, N, block, n_blocks;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    for (;;) {
      const int64_t b = next.fetch_add(1, std::memory_order_relaxed);
      if (b >= n_blocks) return;
      const int64_t n0 = b * block, n1 = std::min(N, n0 + block);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int mm = int(std::min<int64_t>(kMaxRows, M - m0));
        pick<W>(mm, std::make_integer_sequence<int, kMaxRows>{})(x + m0 * K, w, y + m0 * N, K, N, n0, n1);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <ffi::DataType WT>
ffi::Error RowsGemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w, ffi::Buffer<ffi::S32> index,
                    ffi::ResultBuffer<ffi::F32> y) {
  using W = std::conditional_t<WT == ffi::DataType::F32, float, uint16_t>;
  const auto wd = w.dimensions();
  const int64_t rank = int64_t(wd.size());
  if (rank < 2) return ffi::Error::InvalidArgument("jdeep rows_gemm: the weight needs at least 2 dims");
  const int64_t N = wd[rank - 2], K = wd[rank - 1];
  const int64_t n_index = int64_t(index.element_count());
  if (n_index != rank - 2) return ffi::Error::InvalidArgument("jdeep rows_gemm: one index per stack dim");
  const auto xd = x.dimensions();
  if (xd.size() == 0 || xd[xd.size() - 1] != K) return ffi::Error::InvalidArgument("jdeep rows_gemm: x's last dim != K");
  const int64_t M = int64_t(x.element_count()) / K;
  int64_t offset = 0;  // the chosen matrix, row-major over the stack dims
  for (int64_t i = 0; i < n_index; ++i) {
    const int64_t at = std::clamp<int64_t>(index.typed_data()[i], 0, wd[i] - 1);
    offset = offset * wd[i] + at;
  }
  if (M == 0 || N == 0) return ffi::Error::Success();

  auto work = std::make_shared<Work<W>>();
  work->x = x.typed_data();
  work->w = reinterpret_cast<const W*>(w.untyped_data()) + offset * N * K;
  work->y = y->typed_data();
  work->M = M;
  work->K = K;
  work->N = N;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // about 4 blocks per thread for balance, at least 16 weight rows each, an even count (rows go in pairs)
  int64_t block = std::max<int64_t>(16, (N + 4 * threads - 1) / (4 * threads));
  work->block = (block + 1) & ~int64_t(1);
  work->n_blocks = (N + work->block - 1) / work->block;
  const int64_t helpers = std::min(threads, work->n_blocks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < work->n_blocks) std::this_thread::yield();  // blocks in flight
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdeepRowsGemmF32, RowsGemm<ffi::DataType::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdeepRowsGemmBF16, RowsGemm<ffi::DataType::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
