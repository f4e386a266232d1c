// Paged causal attention on the CPU: the "cpu" backend of kernels.paged_attention (and, at
// the end of the file, of kernels.write_kv_cache).
//
// The torch backend (kernels/reference.py) copies every sequence's K/V out of the paged cache
// into a padded batch before one SDPA call; at decode that copy, plus zeroing the stale rows it
// drags along, costs more than the attention itself. This kernel reads K/V in place through the
// block table, once per KV head, and never touches a slot past seq_len (so stale or NaN slots
// cannot leak in).
//
// Work item = (sequence, KV heads, run of query tokens); its rows are the (token, query head)
// pairs of those KV heads (see plan_items for how spans are cut). Each item walks the sequence's
// blocks in order with an online softmax (flash attention): running max m and sum l per row, and
// acc = acc * alpha + weights . V, per partition of 256 positions: all scores first (16
// positions' dot products reduced together), one softmax update per row, then weights . V for
// the rows of a KV head together (see attend). A row's arithmetic depends on its span alone, not
// on the batch or on how the span was cut into items. At decode the kernel reads as many bytes as
// it computes on, from random addresses: the next block is prefetched into L2, a few lines per
// row of work. (Prefill through BLAS GEMMs per block was 1.1-1.7x slower on the dev CPU.)
// Every row sees position 0, so m is finite after the first update. Accumulation is in float32
// whatever the dtypes: bf16/fp16 cache rows are widened block by block, and the cache may be
// 16-bit under float32 queries (kv_cache_dtype), which halves the bytes a decode reads.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <omp.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kMaxRows = 96;  // query rows per work item
constexpr int64_t kWholeHeadsMaxRows = 32;  // rows up to which a span is one item on all heads
constexpr int kRun = 4;  // Vecs of the head dim accumulated in independent chains
// Rows sharing V rows accumulated together: kRowGroup * kRun accumulators stay in registers.
constexpr int kRowGroup = Vec::size() >= 16 ? 4 : 2;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t tokens_per_item(int64_t group) { return std::max<int64_t>(1, kMaxRows / group); }

struct WorkItem {
  int64_t seq;
  int64_t kv_head;  // first KV head
  int64_t num_kv_heads;
  int64_t first_token;  // row of query/out
  int64_t num_tokens;
  int64_t first_pos;  // position of first_token in its sequence
  int64_t span_start;  // position of its span's first token (where a tree mask starts)
};

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  }
  float sum = at::vec::vec_reduce_all([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

#if defined(CPU_CAPABILITY_AVX512)
// Lane sums of 16 vectors as one vector: out[j] = sum(a[j]). A pairwise tree (unpack within
// 128-bit lanes, then across them) does it in 45 shuffles and adds, where 16 separate horizontal
// reductions would take 128 and leave their results in scalars.
inline __m512 lane_sums_16(const __m512 (&a)[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a2i 0+2, a2i+1 0+2, a2i 1+3, a2i+1 1+3]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of a4i .. a4i+3
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 e[2];
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes: [c2i 0+1, c2i 2+3, c2i+1 0+1, c2i+1 2+3]
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88),
                       _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}
#endif

// score[j] = q . k[j] for j < n.
inline void block_scores(const float* q, const float* const* k, int64_t n, int64_t D,
                         float* score) {
#if defined(CPU_CAPABILITY_AVX512)
  if (D % 16 == 0) {  // 16 positions at a time: 16 independent FMA chains, one lane-sum tree
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, n - j0));
      const float* rows[16];
      for (int j = 0; j < 16; ++j) rows[j] = k[j0 + (j < m ? j : 0)];  // spares repeat row 0
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qd = _mm512_loadu_ps(q + d);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(rows[j] + d), acc[j]);
      }
      _mm512_mask_storeu_ps(score + j0, static_cast<__mmask16>((1u << m) - 1), lane_sums_16(acc));
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) score[j] = dot(q, k[j], D);
}

// Vec::size() cache values from p as floats (exact: every bf16 and fp16 value is a float32).
template <typename C>
C10_ALWAYS_INLINE Vec load_wide(const C* p) {
  if constexpr (std::is_same_v<C, float>) {
    return Vec::loadu(p);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<C, at::BFloat16>) {  // bf16 is float32's upper half
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<C, at::BFloat16>) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
#else
    float wide[Vec::size()];
    for (int i = 0; i < Vec::size(); ++i) wide[i] = static_cast<float>(p[i]);
    return Vec::loadu(wide);
#endif
  }
}

// acc_r = acc_r * alpha_r + sum_j weight_r[j] v[j] for R rows that share the block's V rows:
// each V load feeds R rows, and R * kRun independent FMA chains hide the FMA latency. A row's
// arithmetic is the same whatever R (so whatever the batch around it).
template <int R, typename C>
inline void accumulate_v(float* const* acc, const float* alpha, const float* const* weight,
                         const C* const* v, int64_t seen, int64_t D) {
  int64_t d = 0;
  for (; d + kRun * Vec::size() <= D; d += kRun * Vec::size()) {
    Vec a[R][kRun];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < kRun; ++c) {
        a[r][c] = Vec::loadu(acc[r] + d + c * Vec::size()) * Vec(alpha[r]);
      }
    }
    for (int64_t j = 0; j < seen; ++j) {
      Vec vj[kRun];
      for (int c = 0; c < kRun; ++c) vj[c] = load_wide(v[j] + d + c * Vec::size());
      for (int r = 0; r < R; ++r) {
        const Vec w(weight[r][j]);
        for (int c = 0; c < kRun; ++c) a[r][c] = at::vec::fmadd(w, vj[c], a[r][c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < kRun; ++c) a[r][c].store(acc[r] + d + c * Vec::size());
    }
  }
  for (int r = 0; r < R; ++r) {  // the head dim's rest: single Vecs, then scalars
    int64_t e = d;
    for (; e + Vec::size() <= D; e += Vec::size()) {
      Vec a = Vec::loadu(acc[r] + e) * Vec(alpha[r]);
      for (int64_t j = 0; j < seen; ++j) a = at::vec::fmadd(Vec(weight[r][j]), load_wide(v[j] + e), a);
      a.store(acc[r] + e);
    }
    for (; e < D; ++e) {
      float a = acc[r][e] * alpha[r];
      for (int64_t j = 0; j < seen; ++j) a += weight[r][j] * static_cast<float>(v[j][e]);
      acc[r][e] = a;
    }
  }
}

// Rows of a cache block to prefetch: `rows` rows of row_bytes bytes, `stride` bytes apart.
struct RowSet {
  const char* base = nullptr;
  int64_t rows = 0, stride = 0;
};

// Prefetches the next cache block's rows (the hardware cannot guess where it is) a few cache
// lines at a time, interleaved with the work on the current block: issued all at once, the
// prefetches fill the core's miss queues and the compute's own loads wait behind them.
class BlockPrefetcher {
 public:
  void start(int64_t row_bytes, RowSet a, RowSet b = {}) {
    sets_[0] = a, sets_[1] = b, row_bytes_ = row_bytes, set_ = 0, row_ = 0;
    line_ = end_ = nullptr;
  }
  int64_t lines() const {  // an upper bound
    return (sets_[0].rows + sets_[1].rows) * ((row_bytes_ + 63) / 64 + 1);
  }
  void step(int64_t lines) {  // the next `lines` lines, or all that are left
    for (; lines > 0; --lines, line_ += 64) {
      if (line_ >= end_ && !next_run()) return;
      __builtin_prefetch(line_, 0, 2);  // into L2
    }
  }

 private:
  // The next run of adjacent rows (a block's rows are one run in the standard layouts).
  bool next_run() {
    for (; set_ < 2 && row_ == sets_[set_].rows; ++set_) row_ = 0;
    if (set_ == 2) return false;
    const RowSet& rows = sets_[set_];
    const char* first = rows.base + row_ * rows.stride;
    end_ = first + row_bytes_;
    while (++row_ < rows.rows && rows.base + row_ * rows.stride == end_) end_ += row_bytes_;
    line_ = first - reinterpret_cast<uintptr_t>(first) % 64;
    return true;
  }

  RowSet sets_[2];
  int64_t row_bytes_ = 0, set_ = 0, row_ = 0;
  const char *line_ = nullptr, *end_ = nullptr;  // the current run's next line and its end
};

// A cache row as float32: the row itself for a float32 cache, else a float32 copy in buf (exact:
// every bf16 and fp16 value is a float32 value).
template <typename C>
inline const float* as_float(const C* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<C, float>) {
    return row;
  } else {
    int64_t d = 0;
    for (; d + Vec::size() <= n; d += Vec::size()) load_wide(row + d).store(buf + d);
    for (; d < n; ++d) buf[d] = static_cast<float>(row[d]);
    return buf;
  }
}

// T: the query's and out's dtype; C: the cache's (T itself, or 16-bit under a float32 T).
template <typename T, typename C>
struct Problem {
  const T* query;
  const C* k_cache;
  const C* v_cache;
  T* out;
  const int64_t* block_tables;
  const int64_t* tree_mask;  // [T] or nullptr (causal): see hide_off_tree
  int64_t q_stride[2], out_stride[2], k_stride[3], v_stride[3], table_stride;
  int64_t group, num_kv_heads, head_dim, block_size;
  float scale;
};

// Positions per partition of the dot path: scores for a partition stay in L1/L2.
constexpr int64_t kPartition = 256;

inline int64_t partition_width(int64_t block_size) {
  return std::max<int64_t>(1, kPartition / block_size) * block_size;
}

// C: the cache's dtype. K rows are widened into k_buf (each is read by the G query rows of its KV
// head, one row at a time); V rows are read in place, widened as they are loaded (accumulate_v
// reads each once for all the rows of its KV head).
template <typename C>
struct Scratch {
  std::vector<float> q, acc, scores, m, l, alpha, ones, k_buf;
  std::vector<const float*> k_rows;  // [kv head][position] of the current block
  std::vector<const C*> v_rows;
  Scratch(int64_t rows, int64_t num_kv_heads, int64_t head_dim, int64_t block_size)
      : q(rows * head_dim),
        acc(rows * head_dim),
        scores(rows * partition_width(block_size)),
        m(rows),
        l(rows),
        alpha(rows),
        ones(rows, 1.f),
        k_buf(num_kv_heads * block_size * head_dim),
        k_rows(num_kv_heads * block_size),
        v_rows(num_kv_heads * block_size) {}
};

// One work item's view of the cache: its sequence's blocks, on its KV heads.
template <typename T, typename C>
struct ItemCache {
  const Problem<T, C>& p;
  const WorkItem& w;
  const int64_t* table;

  ItemCache(const Problem<T, C>& problem, const WorkItem& item)
      : p(problem), w(item), table(problem.block_tables + item.seq * problem.table_stride) {}

  int64_t positions(int64_t b) const {  // positions of block b in use
    return std::min(p.block_size, w.first_pos + w.num_tokens - b * p.block_size);
  }
  const C* block(const C* cache, const int64_t (&stride)[3], int64_t b) const {
    return cache + table[b] * stride[0] + w.kv_head * stride[2];
  }
  RowSet rows(bool v, int64_t b) const {
    const C* start = v ? block(p.v_cache, p.v_stride, b) : block(p.k_cache, p.k_stride, b);
    return {reinterpret_cast<const char*>(start), positions(b),
            (v ? p.v_stride[1] : p.k_stride[1]) * static_cast<int64_t>(sizeof(C))};
  }
  int64_t row_bytes() const { return w.num_kv_heads * p.head_dim * sizeof(C); }
  // Block b's K rows as float32 pointers: k_rows[h * B + j] for j < positions(b).
  void load_k(int64_t b, Scratch<C>& s) const {
    const C* start = block(p.k_cache, p.k_stride, b);
    const int64_t B = p.block_size, D = p.head_dim, n = positions(b);
    for (int64_t h = 0; h < w.num_kv_heads; ++h) {
      for (int64_t j = 0; j < n; ++j) {
        s.k_rows[h * B + j] =
            as_float(start + j * p.k_stride[1] + h * p.k_stride[2], s.k_buf.data() + (h * B + j) * D, D);
      }
    }
  }
  // Block b's V rows in the cache: v_rows[h * B + j] for j < positions(b).
  void load_v(int64_t b, Scratch<C>& s) const {
    const C* start = block(p.v_cache, p.v_stride, b);
    const int64_t B = p.block_size, n = positions(b);
    for (int64_t h = 0; h < w.num_kv_heads; ++h) {
      for (int64_t j = 0; j < n; ++j) s.v_rows[h * B + j] = start + j * p.v_stride[1] + h * p.v_stride[2];
    }
  }
};

// Folds a row's new scores (len of them, -inf where masked) into its online softmax: scores
// become weights exp(score - m), l and m are updated, and the factor acc must be scaled by is
// returned. Every row sees position 0, so m is finite after the first block or partition.
inline float softmax_update(float* score, int64_t len, float& m, float& l) {
  const float top = at::vec::reduce_all<float>(
      [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, score, len);
  const float m_new = std::max(m, top);
  const float alpha = std::exp(m - m_new);  // 0 on the first update
  at::vec::map([m_new](Vec x) { return (x - Vec(m_new)).exp_u20(); }, score, score, len);
  l = l * alpha + at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, score, len);
  m = m_new;
  return alpha;
}

// A tree span (kernels.paged_attention's tree_mask): bit j of `bits` clear hides token j of the
// span (j < 64) from this row. score holds the row's scores for positions base.. base + seen - 1.
inline void hide_off_tree(int64_t bits, int64_t span_start, int64_t base, int64_t seen,
                          float* score) {
  const int64_t first = std::max<int64_t>(0, span_start - base);
  const int64_t last = std::min<int64_t>(seen, span_start + 64 - base);
  for (int64_t j = first; j < last; ++j) {
    if (!((static_cast<uint64_t>(bits) >> (base + j - span_start)) & 1u)) score[j] = kNegInf;
  }
}

// The item's rows over its context, cut into partitions of kPartition positions. Per partition,
// pass 1 takes every block's scores (16 positions' dot products at a time), each row's softmax
// is updated once over the whole partition, and pass 2 adds weights . V block by block for the
// rows of a KV head together. Blocks are prefetched in the order they are read: a partition's K
// blocks, then its V blocks.
template <typename T, typename C>
void walk_partitions(const ItemCache<T, C>& c, Scratch<C>& s) {
  const Problem<T, C>& p = c.p;
  const WorkItem& w = c.w;
  const int64_t G = p.group, D = p.head_dim, B = p.block_size, H = w.num_kv_heads;
  const int64_t rows = w.num_tokens * H * G, width = partition_width(B);
  const int64_t num_blocks = (w.first_pos + w.num_tokens - 1) / B + 1;
  for (int64_t part = 0; part < num_blocks; part += width / B) {
    const int64_t part_end = std::min(num_blocks, part + width / B);
    const auto prefetch_next = [&](BlockPrefetcher& prefetcher, bool v, int64_t b) {
      if (b + 1 < part_end) {
        prefetcher.start(c.row_bytes(), c.rows(v, b + 1));
      } else if (!v) {
        prefetcher.start(c.row_bytes(), c.rows(true, part));
      } else if (part_end < num_blocks) {
        prefetcher.start(c.row_bytes(), c.rows(false, part_end));
      }
      return prefetcher.lines() / rows + 1;
    };
    for (int64_t b = part; b < part_end; ++b) {  // pass 1: scores
      BlockPrefetcher prefetcher;
      const int64_t prefetch_per_row = prefetch_next(prefetcher, false, b);
      c.load_k(b, s);
      const int64_t base = b * B, n = c.positions(b);
      for (int64_t t = 0, r = 0; t < w.num_tokens; ++t) {  // rows: token, KV head, group
        const int64_t seen = std::clamp<int64_t>(w.first_pos + t - base + 1, 0, n);
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t g = 0; g < G; ++g, ++r) {
            prefetcher.step(prefetch_per_row);
            float* score = s.scores.data() + r * width + (b - part) * B;
            block_scores(s.q.data() + r * D, s.k_rows.data() + h * B, seen, D, score);
            std::fill(score + seen, score + B, kNegInf);
            if (p.tree_mask != nullptr) {
              hide_off_tree(p.tree_mask[w.first_token + t], w.span_start, base, seen, score);
            }
          }
        }
      }
    }
    const int64_t len = (part_end - part) * B;
    for (int64_t r = 0; r < rows; ++r) {
      s.alpha[r] = softmax_update(s.scores.data() + r * width, len, s.m[r], s.l[r]);
    }
    for (int64_t b = part; b < part_end; ++b) {  // pass 2: acc = acc * alpha + weights . V
      BlockPrefetcher prefetcher;
      const int64_t prefetch_per_row = prefetch_next(prefetcher, true, b);
      c.load_v(b, s);
      const int64_t base = b * B, n = c.positions(b);
      const float* alpha = (b == part ? s.alpha : s.ones).data();  // scale once per partition
      for (int64_t t = 0, r = 0; t < w.num_tokens; ++t) {
        const int64_t seen = std::clamp<int64_t>(w.first_pos + t - base + 1, 0, n);
        for (int64_t h = 0; h < H; ++h, r += G) {  // this KV head's rows share the V rows
          prefetcher.step(prefetch_per_row * G);
          for (int64_t first = r; first < r + G; first += kRowGroup) {
            const int n_rows = static_cast<int>(std::min<int64_t>(kRowGroup, r + G - first));
            float* acc[kRowGroup];
            const float* weight[kRowGroup];
            for (int i = 0; i < n_rows; ++i) {
              acc[i] = s.acc.data() + (first + i) * D;
              weight[i] = s.scores.data() + (first + i) * width + (b - part) * B;
            }
            const C* const* v = s.v_rows.data() + h * B;
            switch (n_rows) {
              case 1: accumulate_v<1>(acc, alpha + first, weight, v, seen, D); break;
              case 2: accumulate_v<2>(acc, alpha + first, weight, v, seen, D); break;
              case 3: accumulate_v<3>(acc, alpha + first, weight, v, seen, D); break;
              default: accumulate_v<kRowGroup>(acc, alpha + first, weight, v, seen, D); break;
            }
          }
        }
      }
    }
  }
}

template <typename T, typename C>
void attend(const Problem<T, C>& p, const WorkItem& w, Scratch<C>& s) {
  const int64_t G = p.group, D = p.head_dim;
  const int64_t heads_rows = w.num_kv_heads * G;  // rows per token
  const int64_t rows = w.num_tokens * heads_rows;
  // Row r: token r / heads_rows, query head first_head + r % heads_rows, KV head that / G.
  const int64_t first_head = w.kv_head * G;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = p.query + (w.first_token + r / heads_rows) * p.q_stride[0] +
                   (first_head + r % heads_rows) * p.q_stride[1];
    for (int64_t d = 0; d < D; ++d) s.q[r * D + d] = static_cast<float>(src[d]) * p.scale;
  }
  std::fill_n(s.acc.begin(), rows * D, 0.f);
  std::fill_n(s.m.begin(), rows, kNegInf);
  std::fill_n(s.l.begin(), rows, 0.f);
  walk_partitions(ItemCache<T, C>(p, w), s);
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = p.out + (w.first_token + r / heads_rows) * p.out_stride[0] +
             (first_head + r % heads_rows) * p.out_stride[1];
    const float inv = 1.f / s.l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(s.acc[r * D + d] * inv);
  }
}

// Splits the spans into work items after checking the values the shape checks cannot see.
//
// A span with few rows (decode, short verify spans) is one item over all KV heads when there are
// enough sequences to keep every thread busy: it then reads each cache block as one contiguous
// run, which the hardware prefetcher streams. Other spans are cut per KV head into runs of
// kMaxRows / G tokens, so that each K/V block read serves many rows. How a span is cut does not
// change its rows' arithmetic.
std::vector<WorkItem> plan_items(const at::Tensor& cu_query_lens, const at::Tensor& seq_lens,
                                 const at::Tensor& block_tables, int64_t num_tokens,
                                 int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                                 int64_t group) {
  const auto cu = cu_query_lens.accessor<int64_t, 1>();
  const auto kv = seq_lens.accessor<int64_t, 1>();
  const auto table = block_tables.accessor<int64_t, 2>();
  const int64_t num_seqs = kv.size(0);
  // Comparisons only (no sums that could overflow on hostile values), all before any item exists.
  TORCH_CHECK_VALUE(cu[0] == 0 && cu[num_seqs] == num_tokens,
                    "cu_query_lens must start at 0, be non-decreasing and end at num_tokens=",
                    num_tokens);
  int64_t num_spans = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK_VALUE(cu[i] <= cu[i + 1],
                      "cu_query_lens must start at 0, be non-decreasing and end at num_tokens=",
                      num_tokens);
    const int64_t q_len = cu[i + 1] - cu[i];
    TORCH_CHECK_VALUE(kv[i] >= q_len, "seq_lens[i] must be >= the query span length of sequence i");
    TORCH_CHECK_VALUE(kv[i] <= table.size(1) * block_size,
                      "seq_lens must be <= block_tables.shape[1] * block_size = ",
                      table.size(1) * block_size, ", got ", kv[i]);
    const int64_t used_blocks = (kv[i] + block_size - 1) / block_size;
    for (int64_t b = 0; q_len > 0 && b < used_blocks; ++b) {
      TORCH_CHECK_VALUE(table[i][b] >= 0 && table[i][b] < num_blocks,
                        "block_tables entries in use must be in [0, ", num_blocks,
                        ") (num_blocks), got ", table[i][b]);
    }
    num_spans += q_len > 0;
  }
  const bool many_spans = num_spans >= 2 * omp_get_max_threads();
  const int64_t step = tokens_per_item(group);
  std::vector<WorkItem> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = cu[i + 1] - cu[i];
    const int64_t ctx = kv[i] - q_len;
    if (q_len == 0) continue;
    if (many_spans && q_len * num_kv_heads * group <= kWholeHeadsMaxRows) {
      items.push_back({i, 0, num_kv_heads, cu[i], q_len, ctx, ctx});
      continue;
    }
    for (int64_t t = 0; t < q_len; t += step) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        items.push_back({i, h, 1, cu[i] + t, std::min(step, q_len - t), ctx + t, ctx});
      }
    }
  }
  // Longest contexts first, so that dynamic scheduling ends with the short items.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) {
    return a.first_pos + a.num_tokens > b.first_pos + b.num_tokens;
  });
  return items;
}

template <typename T, typename C>
void run(const Problem<T, C>& p, const std::vector<WorkItem>& items) {
  const int64_t num_items = static_cast<int64_t>(items.size());
  // Scratch for the largest item's rows only: a decode item has G rows, and zeroing scratch for
  // kMaxRows rows (~170 KB a thread at SmolLM2's shapes) took half the kernel's time at a
  // batch-1 decode.
  int64_t max_rows = 1;
  for (const WorkItem& w : items) {
    max_rows = std::max(max_rows, w.num_tokens * w.num_kv_heads * p.group);
  }
#pragma omp parallel if (num_items > 1)
  {
    Scratch<C> scratch(max_rows, p.num_kv_heads, p.head_dim, p.block_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) attend(p, items[i], scratch);
  }
}

template <typename T, typename C = T>
void run_typed(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& tables, const int64_t* tree_mask, at::Tensor& out,
               double scale, const std::vector<WorkItem>& items) {
  const Problem<T, C> p{query.data_ptr<T>(),
                        k_cache.data_ptr<C>(),
                        v_cache.data_ptr<C>(),
                        out.data_ptr<T>(),
                        tables.data_ptr<int64_t>(),
                        tree_mask,
                        {query.stride(0), query.stride(1)},
                        {out.stride(0), out.stride(1)},
                        {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)},
                        {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)},
                        tables.stride(0),
                        query.size(1) / k_cache.size(2),
                        k_cache.size(2),
                        k_cache.size(3),
                        k_cache.size(1),
                        static_cast<float>(scale)};
  run(p, items);
}

// kernels.checks.cache_holds: a cache of `cache` may hold (and be read against) `dtype` tensors.
bool cache_holds(at::ScalarType dtype, at::ScalarType cache) {
  return dtype == cache || (dtype == at::kFloat && (cache == at::kBFloat16 || cache == at::kHalf));
}

// Devices, shapes, dtypes and strides: kernels.checks checks them too, with messages per
// field, but a step's layers call with a plan that skips those Python checks (once per step).
void check_attention_args(const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& cu_query_lens, const at::Tensor& seq_lens,
                          double scale, const at::Tensor& out) {
  for (const at::Tensor* t : {&query, &k_cache, &v_cache, &block_tables, &cu_query_lens,
                              &seq_lens, &out}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "backend 'cpu' needs CPU tensors, got a tensor on ",
                      t->device());
  }
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                        k_cache.size(1) >= 1 && k_cache.size(2) >= 1,
                    "k_cache and v_cache must both be [num_blocks, block_size >= 1, "
                    "num_kv_heads >= 1, head_dim], got ", k_cache.sizes(), " and ",
                    v_cache.sizes());
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK_VALUE(v_cache.scalar_type() == dtype && out.scalar_type() == query.scalar_type() &&
                        cache_holds(query.scalar_type(), dtype),
                    "query and out must have one dtype, the caches one dtype, and the caches' "
                    "must be the query's or 16-bit under float32 queries, got ",
                    query.scalar_type(), ", ", out.scalar_type(), ", ", dtype, " and ",
                    v_cache.scalar_type());
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK_VALUE(query.dim() == 3 && query.size(2) == k_cache.size(3) &&
                        query.size(1) >= num_kv_heads && query.size(1) % num_kv_heads == 0,
                    "query must be [num_tokens, a multiple of num_kv_heads=", num_kv_heads, ", ",
                    k_cache.size(3), "], got ", query.sizes());
  TORCH_CHECK_VALUE(out.sizes() == query.sizes(), "out must have query's shape ", query.sizes(),
                    ", got ", out.sizes());
  TORCH_CHECK_VALUE(query.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 &&
                        v_cache.stride(3) == 1,
                    "query, out and the caches must have head_dim contiguous (stride 1)");
  for (const at::Tensor* t : {&block_tables, &cu_query_lens, &seq_lens}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong,
                      "block_tables, cu_query_lens and seq_lens must be int32 or int64, got ",
                      t->scalar_type());
  }
  const int64_t num_seqs = seq_lens.dim() == 1 ? seq_lens.size(0) : -1;
  TORCH_CHECK_VALUE(num_seqs >= 0 && block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                        cu_query_lens.dim() == 1 && cu_query_lens.size(0) == num_seqs + 1,
                    "seq_lens must be [S], block_tables [S, M] and cu_query_lens [S + 1], got ",
                    seq_lens.sizes(), ", ", block_tables.sizes(), " and ", cu_query_lens.sizes());
  TORCH_CHECK_VALUE(scale > 0.0, "scale must be > 0, got ", scale);
}

// write_kv_cache's copy of src [T, H, D] into cache rows at `slots` (-1 skips a token).
// C = char: the same dtype, copied as bytes; C = BFloat16 or Half: a float32 src rounded to
// nearest even into a 16-bit cache. A row of head_dim elements moves whole when both sides have
// it contiguous.
template <typename C>
void copy_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  using From = std::conditional_t<std::is_same_v<C, char>, char, float>;
  const int64_t item = std::is_same_v<C, char> ? src.element_size() : 1;  // From's per element
  const From* from = static_cast<const From*>(src.data_ptr());
  C* to = static_cast<C*>(cache.data_ptr());
  const int64_t block_size = cache.size(1), heads = cache.size(2), head_dim = cache.size(3);
  const bool rows = src.stride(2) == 1 && cache.stride(3) == 1;
  at::parallel_for(0, src.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      const int64_t block = slots[i] / block_size, offset = slots[i] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const From* s = from + (i * src.stride(0) + h * src.stride(1)) * item;
        C* d = to + (block * cache.stride(0) + offset * cache.stride(1) + h * cache.stride(2)) * item;
        if constexpr (std::is_same_v<C, char>) {
          if (rows) {
            std::memcpy(d, s, head_dim * item);
            continue;
          }
          for (int64_t e = 0; e < head_dim; ++e) {
            std::memcpy(d + e * cache.stride(3) * item, s + e * src.stride(2) * item, item);
          }
        } else {  // round to nearest even, as torch's .to()
          if (rows) {
            at::vec::convert(s, d, head_dim);
            continue;
          }
          for (int64_t e = 0; e < head_dim; ++e) {
            d[e * cache.stride(3)] = static_cast<C>(s[e * src.stride(2)]);
          }
        }
      }
    }
  });
}

}  // namespace

void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& cu_query_lens,
                     const at::Tensor& seq_lens, double scale, at::Tensor& out,
                     const c10::optional<at::Tensor>& tree_mask) {
  check_attention_args(query, k_cache, v_cache, block_tables, cu_query_lens, seq_lens, scale, out);
  if (tree_mask.has_value()) {
    TORCH_CHECK_VALUE(tree_mask->device().is_cpu() && tree_mask->scalar_type() == at::kLong &&
                          tree_mask->dim() == 1 && tree_mask->size(0) == query.size(0) &&
                          tree_mask->is_contiguous(),
                      "tree_mask must be a contiguous int64 CPU tensor [num_tokens=",
                      query.size(0), "], got ", tree_mask->scalar_type(), " ", tree_mask->sizes());
  }
  const int64_t* mask = tree_mask.has_value() ? tree_mask->data_ptr<int64_t>() : nullptr;
  const auto tables = block_tables.to(at::kLong).contiguous();
  const int64_t num_heads = query.size(1), num_kv_heads = k_cache.size(2);
  const auto items = plan_items(cu_query_lens.to(at::kLong), seq_lens.to(at::kLong), tables,
                                query.size(0), k_cache.size(0), k_cache.size(1), num_kv_heads,
                                num_heads / num_kv_heads);
  switch (query.scalar_type()) {
    case at::kFloat:
      if (k_cache.scalar_type() == at::kBFloat16) {
        return run_typed<float, at::BFloat16>(query, k_cache, v_cache, tables, mask, out, scale,
                                              items);
      }
      if (k_cache.scalar_type() == at::kHalf) {
        return run_typed<float, at::Half>(query, k_cache, v_cache, tables, mask, out, scale, items);
      }
      return run_typed<float>(query, k_cache, v_cache, tables, mask, out, scale, items);
    case at::kBFloat16:
      return run_typed<at::BFloat16>(query, k_cache, v_cache, tables, mask, out, scale, items);
    case at::kHalf:
      return run_typed<at::Half>(query, k_cache, v_cache, tables, mask, out, scale, items);
    default:
      TORCH_CHECK_VALUE(false, "the cpu backend supports float32, bfloat16 and float16, got ",
                        query.scalar_type());
  }
}

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&key, &value, &k_cache, &v_cache, &slot_mapping}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "backend 'cpu' needs CPU tensors, got a tensor on ",
                      t->device());
  }
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                    "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
                    "head_dim], got ", k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), block_size = k_cache.size(1);
  const int64_t heads = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK_VALUE(key.dim() == 3 && key.size(1) == heads && key.size(2) == head_dim,
                    "key must be [num_tokens, ", heads, ", ", head_dim,
                    "] to match the cache, got shape ", key.sizes());
  TORCH_CHECK_VALUE(value.sizes() == key.sizes(), "value shape ", value.sizes(),
                    " must equal key shape ", key.sizes());
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK_VALUE(v_cache.scalar_type() == dtype && value.scalar_type() == key.scalar_type() &&
                        cache_holds(key.scalar_type(), dtype),
                    "key/value dtype must equal the cache dtype ", dtype,
                    " (or be float32 over a float16/bfloat16 cache), got ", key.scalar_type(),
                    " and ", value.scalar_type());
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong,
                    "slot_mapping dtype must be int32 or int64, got ", slot_mapping.scalar_type());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
                    "slot_mapping must be [num_tokens=", key.size(0), "], got ",
                    slot_mapping.sizes());
  const auto slots_tensor = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slots = slots_tensor.data_ptr<int64_t>();
  for (int64_t i = 0; i < key.size(0); ++i) {  // all values before any write
    TORCH_CHECK_VALUE(slots[i] == -1 || (slots[i] >= 0 && slots[i] < num_slots),
                      "slot_mapping values must be -1 or in [0, ", num_slots,
                      ") (num_blocks * block_size), got ", slots[i]);
  }
  if (key.scalar_type() == dtype) {
    copy_rows<char>(key, k_cache, slots);
    copy_rows<char>(value, v_cache, slots);
  } else if (dtype == at::kBFloat16) {
    copy_rows<at::BFloat16>(key, k_cache, slots);
    copy_rows<at::BFloat16>(value, v_cache, slots);
  } else {
    copy_rows<at::Half>(key, k_cache, slots);
    copy_rows<at::Half>(value, v_cache, slots);
  }
}
