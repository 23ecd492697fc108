// Retrieval kernels: sign packing, Hamming scoring, histogram-threshold top-k selection.
//
// Semantics are those of kernels/cpu.py, bit for bit:
//   bit j of word w = x[row, 64 w + j] > 0;
//   score[h, t] = sum_{g < G, w < W} popcount(~(q[h G + g, w] ^ k[h, w, t]));
//   selection of r middle tokens per head: every score above the cut, then the lowest-index
//   tokens scoring exactly the cut (equal scores -> lower token index first), ascending.
//
// Shapes (row-major, int64 offsets): q (H, W), k (Hkv, W, N), scores (Hkv, stride) of S = int or
// unsigned short (the fused path keeps 16-bit scores: S <= G * W * 64 < MAX_BINS, half the traffic),
// hist (Hkv, bins), tile_counts (Hkv, tiles, 2) = {above the cut, at the cut}, out (Hkv, K).
// Selection is two passes over the scores after the histogram: count per tile, then write;
// each block finds the cut from the histogram itself, so no kernel only for it.
// Compiled lazily by CuPy (kernels/cuda.py); `nvcc -cubin` checks it in the tests.

typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------------- packing

// One thread per output word. x holds the IEEE bit patterns of the floats (U = 16, 32 or 64-bit
// unsigned): x > 0 exactly when 0 < bits <= bits(+inf) (negatives and NaNs compare above +inf).
// Output word (row, w) goes to out[(row / rows_per_head) * head_stride + (row % rows_per_head)
// * row_stride + w * word_stride + base], which covers plain (..., W) and word-major buffers.
template <typename U>
__global__ void pack_rows(const U* __restrict__ x, u64* __restrict__ out, long long rows, int bits,
                          int words, long long rows_per_head, long long head_stride,
                          long long row_stride, long long word_stride, long long base, U inf_bits) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * words) return;
    long long row = i / words;
    int w = (int)(i % words);
    const U* src = x + row * bits + 64LL * w;
    int count = min(64, bits - 64 * w);
    u64 word = 0;
    for (int j = 0; j < count; ++j) {
        U b = src[j];
        if (b != 0 && b <= inf_bits) word |= 1ULL << j;
    }
    long long head = row / rows_per_head, token = row % rows_per_head;
    out[head * head_stride + token * row_stride + (long long)w * word_stride + base] = word;
}

template __global__ void pack_rows<unsigned short>(const unsigned short*, u64*, long long, int, int,
                                                   long long, long long, long long, long long,
                                                   long long, unsigned short);
template __global__ void pack_rows<unsigned int>(const unsigned int*, u64*, long long, int, int,
                                                 long long, long long, long long, long long,
                                                 long long, unsigned int);
template __global__ void pack_rows<u64>(const u64*, u64*, long long, int, int, long long, long long,
                                        long long, long long, long long, u64);

// ---------------------------------------------------------------------------------- block scan

// Exclusive prefix sum of v over the block (blockDim a multiple of 32, at most 1024);
// *total receives the block sum. Every thread of the block must call it.
__device__ int block_exclusive_scan(int v, int* total) {
    __shared__ int warp_sums[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int s = lane < warps ? warp_sums[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int y = __shfl_up_sync(FULL_MASK, s, o);
            if (lane >= o) s += y;
        }
        warp_sums[lane] = s;  // inclusive sums over warps
    }
    __syncthreads();
    int before = warp ? warp_sums[warp - 1] : 0;
    *total = warp_sums[warps - 1];
    __syncthreads();  // warp_sums is reused by the next call
    return before + x - v;
}

// ---------------------------------------------------------------------------------- scoring

// grid (x: token blocks, y: KV head); shared memory: ~q of the head's G query codes (G * W u64),
// then, when hist != nullptr, a (bins,) int histogram of the scores of tokens [lo, hi).
// Each thread scores SCORE_UNROLL tokens per pass (blockDim apart, so every load stays coalesced),
// loading a word of all of them before any popcount: more loads in flight per thread, which is
// what a single-pass read of the codes needs to approach the memory bandwidth.
#define SCORE_UNROLL 4
template <typename S>
__global__ void hamming_scores(const u64* __restrict__ q, const u64* __restrict__ k,
                               S* __restrict__ scores, int n, long long capacity,
                               long long score_stride, int group, int words,
                               int* __restrict__ hist, int bins, int lo, int hi) {
    extern __shared__ u64 shared[];
    u64* qs = shared;
    int* hs = (int*)(shared + group * words);
    int h = blockIdx.y, gw = group * words;
    for (int i = threadIdx.x; i < gw; i += blockDim.x) qs[i] = ~q[(long long)h * gw + i];
    if (hist)
        for (int i = threadIdx.x; i < bins; i += blockDim.x) hs[i] = 0;
    __syncthreads();
    const u64* kh = k + (long long)h * words * capacity;
    long long pass = (long long)blockDim.x * SCORE_UNROLL;
    for (long long base = (long long)blockIdx.x * pass + threadIdx.x; base < n; base += (long long)gridDim.x * pass) {
        int s[SCORE_UNROLL];
#pragma unroll
        for (int u = 0; u < SCORE_UNROLL; ++u) s[u] = 0;
        for (int w = 0; w < words; ++w) {
            u64 x[SCORE_UNROLL];
#pragma unroll
            for (int u = 0; u < SCORE_UNROLL; ++u) {
                long long t = base + (long long)u * blockDim.x;
                x[u] = t < n ? kh[w * capacity + t] : 0;
            }
#pragma unroll
            for (int u = 0; u < SCORE_UNROLL; ++u)
                for (int g = 0; g < group; ++g) s[u] += __popcll(qs[g * words + w] ^ x[u]);
        }
#pragma unroll
        for (int u = 0; u < SCORE_UNROLL; ++u) {
            long long t = base + (long long)u * blockDim.x;
            if (t < n) {
                scores[h * score_stride + t] = (S)s[u];
                if (hist && t >= lo && t < hi) atomicAdd(&hs[s[u]], 1);
            }
        }
    }
    if (!hist) return;
    __syncthreads();
    for (int i = threadIdx.x; i < bins; i += blockDim.x)
        if (hs[i]) atomicAdd(&hist[(long long)h * bins + i], hs[i]);
}

// grid (x: token blocks, y: KV head): histogram of scores[h, lo:hi) into hist (Hkv, bins).
extern "C" __global__ void score_histogram(const int* __restrict__ scores, long long score_stride,
                                           int lo, int hi, int* __restrict__ hist, int bins) {
    extern __shared__ int hs[];
    int h = blockIdx.y;
    for (int i = threadIdx.x; i < bins; i += blockDim.x) hs[i] = 0;
    __syncthreads();
    for (long long t = lo + (long long)blockIdx.x * blockDim.x + threadIdx.x; t < hi;
         t += (long long)gridDim.x * blockDim.x)
        atomicAdd(&hs[scores[h * score_stride + t]], 1);
    __syncthreads();
    for (int i = threadIdx.x; i < bins; i += blockDim.x)
        if (hs[i]) atomicAdd(&hist[(long long)h * bins + i], hs[i]);
}

// ---------------------------------------------------------------------------------- selection

// Called by every thread of a block: the cut of head h's histogram, i.e. the largest score v with
// #(score >= v) >= r, and how many tokens to take at the cut, ties = r - #(score > cut).
// Each thread owns a run of bins; the run holding the crossing reports it through shared memory.
__device__ void find_cut(const int* __restrict__ hh, int bins, int r, int* cut, int* ties) {
    __shared__ int found[2];
    int per = (bins + blockDim.x - 1) / blockDim.x;
    int b0 = min(bins, (int)threadIdx.x * per), b1 = min(bins, b0 + per);
    int mine = 0;
    for (int v = b0; v < b1; ++v) mine += hh[v];
    int total;
    int below = block_exclusive_scan(mine, &total);
    int above = total - below - mine;  // tokens in bins >= b1
    for (int v = b1 - 1; v >= b0; --v) {
        if (above < r && above + hh[v] >= r) {
            found[0] = v;
            found[1] = r - above;
        }
        above += hh[v];
    }
    __syncthreads();
    *cut = found[0];
    *ties = found[1];
    __syncthreads();  // found is reused by the next call
}

// Tokens per thread in select_count / select_write: a tile is blockDim.x * SELECT_ITEMS tokens
// (kernels/cuda.py passes tile = THREADS * SELECT_ITEMS). Warp w owns the contiguous run of
// 32 * SELECT_ITEMS tokens starting at s0 + w * 32 * SELECT_ITEMS; its item j is the 32 tokens
// run + 32 j + lane, so every load of a warp is one coalesced 32-token read, and the order of the
// tokens is (warp, item, lane): ballots rank a lane among its warp's 32 tokens of an item.
#define SELECT_ITEMS 32

// The scores of this thread's SELECT_ITEMS tokens (-1 outside [s0, s1)). Issued before find_cut,
// so the loads' latency overlaps the histogram scan.
template <typename S>
__device__ void load_items(const S* __restrict__ row, int s0, int s1, int* v) {
    int t0 = s0 + (threadIdx.x >> 5) * 32 * SELECT_ITEMS + (threadIdx.x & 31);
#pragma unroll
    for (int j = 0; j < SELECT_ITEMS; ++j) v[j] = t0 + 32 * j < s1 ? (int)row[t0 + 32 * j] : -1;
}

// above + (ties << 16) of the items against the cut: a tile holds fewer than 65536 of each.
__device__ int count_items(const int* v, int cut) {
    int packed = 0;
#pragma unroll
    for (int j = 0; j < SELECT_ITEMS; ++j) packed += (v[j] > cut) + ((v[j] == cut) << 16);
    return packed;
}

// grid (x: tiles of `tile` tokens of [lo, hi), y: head): per tile, how many tokens score
// above the cut and how many score exactly the cut, into tile_counts[h, tile] = {above, ties}.
template <typename S>
__global__ void select_count(const S* __restrict__ scores, long long score_stride, int lo, int hi,
                             int tile, const int* __restrict__ hist, int bins, int r,
                             int* __restrict__ tile_counts) {
    int h = blockIdx.y, cut, ties, total;
    int s0 = lo + blockIdx.x * tile, v[SELECT_ITEMS];
    load_items(scores + h * score_stride, s0, min(hi, s0 + tile), v);
    find_cut(hist + (long long)h * bins, bins, r, &cut, &ties);
    block_exclusive_scan(count_items(v, cut), &total);
    if (threadIdx.x == 0) {
        int* c = tile_counts + ((long long)h * gridDim.x + blockIdx.x) * 2;
        c[0] = total & 0xffff;
        c[1] = total >> 16;
    }
}

// grid (x: tiles, y: head): ordered compaction. A token scoring above the cut, or scoring
// the cut with fewer than `ties` equal tokens before it, goes to position
// #(above before it) + min(#(ties before it), ties) of the retrieved part of out[h]; the
// counts before the tile are summed from tile_counts, those before a warp's run come from
// one block scan, and within the run each item's ballots rank the lanes. Tile 0 also writes
// the forced indices: out[h, :sinks_end] = 0.., out[h, sinks_end + r:] = window_start..n-1.
template <typename S>
__global__ void select_write(const S* __restrict__ scores, long long score_stride, int n,
                             int sinks_end, int window_start, int tile, const int* __restrict__ hist,
                             int bins, int r, const int* __restrict__ tile_counts,
                             int* __restrict__ out, int out_stride) {
    int h = blockIdx.y, cut, ties, total;
    int s0 = sinks_end + blockIdx.x * tile, v[SELECT_ITEMS];
    load_items(scores + h * score_stride, s0, min(window_start, s0 + tile), v);
    find_cut(hist + (long long)h * bins, bins, r, &cut, &ties);
    int mine = count_items(v, cut);
    const int* c = tile_counts + (long long)h * gridDim.x * 2;
    int above_sum = 0, ties_sum = 0;
    for (int i = threadIdx.x; i < (int)blockIdx.x; i += blockDim.x) {
        above_sum += c[2 * i];
        ties_sum += c[2 * i + 1];
    }
    block_exclusive_scan(above_sum, &total);
    int above_before = total;
    block_exclusive_scan(ties_sum, &total);
    int ties_before = total;
    int* row = out + (long long)h * out_stride;
    if (blockIdx.x == 0) {
        for (int t = threadIdx.x; t < sinks_end; t += blockDim.x) row[t] = t;
        for (int t = window_start + threadIdx.x; t < n; t += blockDim.x)
            row[sinks_end + r + t - window_start] = t;
    }
    int lane = threadIdx.x & 31;
    int warp_before = __shfl_sync(FULL_MASK, block_exclusive_scan(mine, &total), 0);  // lane 0: the warp's run
    int a = above_before + (warp_before & 0xffff), e = ties_before + (warp_before >> 16);
    unsigned lower = (1u << lane) - 1u;  // the lanes before this one
    int t = s0 + (threadIdx.x >> 5) * 32 * SELECT_ITEMS + lane;
#pragma unroll
    for (int j = 0; j < SELECT_ITEMS; ++j, t += 32) {
        unsigned above = __ballot_sync(FULL_MASK, v[j] > cut), tied = __ballot_sync(FULL_MASK, v[j] == cut);
        int ra = a + __popc(above & lower), re = e + __popc(tied & lower);
        if (v[j] > cut)
            row[sinks_end + ra + min(re, ties)] = t;
        else if (v[j] == cut && re < ties)
            row[sinks_end + ra + re] = t;
        a += __popc(above);
        e += __popc(tied);
    }
}

// ---------------------------------------------------------------------------------- instantiations

// Every template kernel for both score types, so `nvcc -cubin` builds them all (CuPy names them
// to NVRTC through kernels/cuda.py's NAME_EXPRESSIONS).
#define SCORE_KERNELS(S)                                                                          \
    template __global__ void hamming_scores<S>(const u64*, const u64*, S*, int, long long,         \
                                               long long, int, int, int*, int, int, int);          \
    template __global__ void select_count<S>(const S*, long long, int, int, int, const int*, int,  \
                                             int, int*);                                           \
    template __global__ void select_write<S>(const S*, long long, int, int, int, int, const int*,  \
                                             int, int, const int*, int*, int);
SCORE_KERNELS(int)
SCORE_KERNELS(unsigned short)
