// Submanifold sparse 3D convolution as an implicit GEMM (backends/sparse_conv/metal.py dispatches it).
//
// out[r, n] = bias[n] + sum_k sum_c feats[table[r, k], c] * W[n, k, c]
//
// A threadgroup of 16 x 16 threads owns a tile of SC_TM output rows x SC_TN output channels (each thread a
// 2 x 4 patch). For every kernel offset it reads the tile's neighbour rows from the table, gathers their input
// channels SC_TK at a time into threadgroup memory and multiplies them with the matching weight slice, so the
// N x K x Cin gather never exists in device memory. Offsets no row of the tile uses are skipped (the dispatcher
// orders rows by their neighbour masks so that this is common). Products accumulate in fp32 for every dtype.
//
// Rows are visited through `order` (row i of the tile is original row order[i]) and `table` is already in that
// order. Launches cover row tiles [tile0, tile0 + grid height) so that no single launch runs long enough for the
// macOS GPU watchdog.
#include <metal_stdlib>
using namespace metal;

#define SC_TM 32
#define SC_TN 64
#define SC_TK 16
#define SC_THREADS 256

template <typename T>
[[kernel]] void sparse_conv_implicit_gemm(
    device const T* feats [[buffer(0)]],     // [N, Cin]
    device const int* table [[buffer(1)]],   // [N, K] neighbour row (original numbering) or -1, in `order`
    device const int* order [[buffer(2)]],   // [N] original row of each processed row
    device const T* weight [[buffer(3)]],    // [Cout, K, Cin] (spconv's [Cout, k, k, k, Cin], flattened)
    device const T* bias [[buffer(4)]],      // [Cout], read only when has_bias != 0
    device T* out [[buffer(5)]],             // [N, Cout]
    constant long& n_rows [[buffer(6)]],
    constant long& cin [[buffer(7)]],
    constant long& cout [[buffer(8)]],
    constant long& k_vol [[buffer(9)]],
    constant long& has_bias [[buffer(10)]],
    constant long& tile0 [[buffer(11)]],
    uint3 tid [[thread_position_in_threadgroup]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint3 tgsize [[threads_per_threadgroup]]) {
    threadgroup float a_tile[SC_TK][SC_TM + 1];  // gathered inputs, channel-major; +1 spreads the banks
    threadgroup float b_tile[SC_TK][SC_TN];      // weights of this offset and channel slice
    threadgroup int src_rows[SC_TM];
    threadgroup int tile_uses_offset;

    const uint lane = tid.y * 16 + tid.x;
    const long row0 = (tile0 + long(tgid.y)) * SC_TM;
    const long col0 = long(tgid.x) * SC_TN;
    float acc[2][4];
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (long k = 0; k < k_vol; ++k) {
        if (lane < SC_TM) {
            const long r = row0 + lane;
            src_rows[lane] = r < n_rows ? table[r * k_vol + k] : -1;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (lane == 0) {
            int used = 0;
            for (int i = 0; i < SC_TM; ++i) used |= src_rows[i] >= 0 ? 1 : 0;
            tile_uses_offset = used;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tile_uses_offset == 0) continue;  // the same value for every lane: the barriers stay uniform

        for (long c0 = 0; c0 < cin; c0 += SC_TK) {
            for (uint e = lane; e < SC_TM * SC_TK; e += SC_THREADS) {
                const uint r = e / SC_TK, c = e % SC_TK;  // neighbouring lanes read neighbouring channels
                const int src = src_rows[r];
                const long ch = c0 + c;
                a_tile[c][r] = (src >= 0 && ch < cin) ? float(feats[long(src) * cin + ch]) : 0.0f;
            }
            for (uint e = lane; e < SC_TN * SC_TK; e += SC_THREADS) {
                const uint n = e / SC_TK, c = e % SC_TK;
                const long co = col0 + n, ch = c0 + c;
                b_tile[c][n] = (co < cout && ch < cin) ? float(weight[(co * k_vol + k) * cin + ch]) : 0.0f;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            for (uint c = 0; c < SC_TK; ++c) {
                const float a0 = a_tile[c][tid.y * 2];
                const float a1 = a_tile[c][tid.y * 2 + 1];
                for (int j = 0; j < 4; ++j) {
                    const float b = b_tile[c][tid.x + 16 * j];
                    acc[0][j] = fma(a0, b, acc[0][j]);
                    acc[1][j] = fma(a1, b, acc[1][j]);
                }
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
    }

    for (int i = 0; i < 2; ++i) {
        const long r = row0 + tid.y * 2 + i;
        if (r >= n_rows) continue;
        const long dst = long(order[r]);
        for (int j = 0; j < 4; ++j) {
            const long co = col0 + tid.x + 16 * j;
            if (co < cout) {
                const float b = has_bias != 0 ? float(bias[co]) : 0.0f;
                out[dst * cout + co] = T(acc[i][j] + b);
            }
        }
    }
}

template [[host_name("sparse_conv_f32")]] [[kernel]] decltype(sparse_conv_implicit_gemm<float>) sparse_conv_implicit_gemm<float>;
template [[host_name("sparse_conv_f16")]] [[kernel]] decltype(sparse_conv_implicit_gemm<half>) sparse_conv_implicit_gemm<half>;
#if defined(__HAVE_BFLOAT__)
template [[host_name("sparse_conv_bf16")]] [[kernel]] decltype(sparse_conv_implicit_gemm<bfloat>) sparse_conv_implicit_gemm<bfloat>;
#endif
