// Attention over packed variable-length sequences (flash_attn's varlen layout), flash-style: one threadgroup per
// (query tile, head, sequence) walks the sequence's keys in tiles of VA_BK with an online softmax, so no
// Lq x Lk score matrix is ever stored. backends/attn/metal.py dispatches it.
//
// q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv], out [Tq, H, Dv]; sequence s owns q rows cu_q[s]..cu_q[s+1] and
// k/v rows cu_k[s]..cu_k[s+1]. D, Dv <= VA_DMAX. Queries with no keys get zeros (as flash_attn).
// The grid is (query tiles x VA_THREADS, heads, sequences) offset by (q_tile0, 0, seq0): big problems are split
// into several launches so that none runs long enough for the macOS GPU watchdog.
#include <metal_stdlib>
using namespace metal;

#define VA_BQ 16
#define VA_BK 32
#define VA_DMAX 128
#define VA_THREADS 128
#define VA_PER_THREAD (VA_BQ * VA_DMAX / VA_THREADS)
#define VA_NEG_BIG (-1.0e30f)

template <typename T>
[[kernel]] void varlen_attention_fwd(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device const int* cu_q [[buffer(3)]],
    device const int* cu_k [[buffer(4)]],
    device T* out [[buffer(5)]],
    constant long& heads [[buffer(6)]],
    constant long& d [[buffer(7)]],
    constant long& dv [[buffer(8)]],
    constant float& scale [[buffer(9)]],
    constant long& q_tile0 [[buffer(10)]],
    constant long& seq0 [[buffer(11)]],
    uint3 tid [[thread_position_in_threadgroup]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint3 tgsize [[threads_per_threadgroup]]) {
    threadgroup float q_tile[VA_BQ][VA_DMAX];      // scaled queries
    threadgroup float kv_tile[VA_BK][VA_DMAX + 1];  // keys, then values, of the current key tile
    threadgroup float p_tile[VA_BQ][VA_BK + 1];     // scores, then probabilities
    threadgroup float row_rescale[VA_BQ];
    threadgroup float row_total[VA_BQ];

    const uint lane = tid.x;
    const long seq = seq0 + long(tgid.z);
    const long h = long(tgid.y);
    const long q_end = long(cu_q[seq + 1]);
    const long k_begin = long(cu_k[seq]), k_end = long(cu_k[seq + 1]);
    const long qrow0 = long(cu_q[seq]) + (q_tile0 + long(tgid.x)) * VA_BQ;
    if (qrow0 >= q_end) return;  // the whole threadgroup leaves together: no barrier is left waiting
    const long nq = q_end - qrow0 < VA_BQ ? q_end - qrow0 : long(VA_BQ);

    for (long e = lane; e < VA_BQ * d; e += VA_THREADS) {
        const long i = e / d, c = e % d;
        q_tile[i][c] = i < nq ? float(q[((qrow0 + i) * heads + h) * d + c]) * scale : 0.0f;
    }
    float o_acc[VA_PER_THREAD];  // element lane + t * VA_THREADS of the [VA_BQ, dv] output tile
    for (int t = 0; t < VA_PER_THREAD; ++t) o_acc[t] = 0.0f;
    float row_max = VA_NEG_BIG, row_sum = 0.0f;  // meaningful in lanes < VA_BQ (one query row each)
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (long kt = k_begin; kt < k_end; kt += VA_BK) {
        const long nk = k_end - kt < VA_BK ? k_end - kt : long(VA_BK);
        for (long e = lane; e < VA_BK * d; e += VA_THREADS) {
            const long j = e / d, c = e % d;
            kv_tile[j][c] = j < nk ? float(k[((kt + j) * heads + h) * d + c]) : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint e = lane; e < VA_BQ * VA_BK; e += VA_THREADS) {
            const uint i = e / VA_BK, j = e % VA_BK;
            float s = 0.0f;
            for (long c = 0; c < d; ++c) s = fma(q_tile[i][c], kv_tile[j][c], s);
            p_tile[i][j] = s;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (lane < VA_BQ) {
            float m = row_max;
            for (long j = 0; j < nk; ++j) m = max(m, p_tile[lane][j]);
            const float rescale = exp(row_max - m);
            float sum = 0.0f;
            for (long j = 0; j < VA_BK; ++j) {
                const float p = j < nk ? exp(p_tile[lane][j] - m) : 0.0f;
                p_tile[lane][j] = p;
                sum += p;
            }
            row_sum = row_sum * rescale + sum;
            row_max = m;
            row_rescale[lane] = rescale;
        }
        for (long e = lane; e < VA_BK * dv; e += VA_THREADS) {  // keys are no longer read: reuse the tile
            const long j = e / dv, c = e % dv;
            kv_tile[j][c] = j < nk ? float(v[((kt + j) * heads + h) * dv + c]) : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int t = 0; t < VA_PER_THREAD; ++t) {
            const long e = long(lane) + long(t) * VA_THREADS;
            if (e >= VA_BQ * dv) break;
            const long i = e / dv, c = e % dv;
            float acc = o_acc[t] * row_rescale[i];
            for (long j = 0; j < nk; ++j) acc = fma(p_tile[i][j], kv_tile[j][c], acc);
            o_acc[t] = acc;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    if (lane < VA_BQ) row_total[lane] = row_sum;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int t = 0; t < VA_PER_THREAD; ++t) {
        const long e = long(lane) + long(t) * VA_THREADS;
        if (e >= VA_BQ * dv) break;
        const long i = e / dv, c = e % dv;
        if (i < nq) {
            const float total = row_total[i];
            out[((qrow0 + i) * heads + h) * dv + c] = T(total > 0.0f ? o_acc[t] / total : 0.0f);
        }
    }
}

template [[host_name("varlen_attention_f32")]] [[kernel]] decltype(varlen_attention_fwd<float>) varlen_attention_fwd<float>;
template [[host_name("varlen_attention_f16")]] [[kernel]] decltype(varlen_attention_fwd<half>) varlen_attention_fwd<half>;
#if defined(__HAVE_BFLOAT__)
template [[host_name("varlen_attention_bf16")]] [[kernel]] decltype(varlen_attention_fwd<bfloat>) varlen_attention_fwd<bfloat>;
#endif
