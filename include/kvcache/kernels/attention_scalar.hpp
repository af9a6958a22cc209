// kvcache kernels: the scalar attention oracle (kernel_path::scalar).
//
// The plain reference loop the benchmarks and tests compare the SIMD kernel against:
// one query row, one head, one cell, one element at a time, online softmax in f32.
// It reads K / V through the layer view (format/kv_view.hpp) and visibility from the
// cells' positions (a flat array) and the op's view of their sequence membership
// (`seqs.test(c, s)`, as for the SIMD kernel's attn_meta): no cache or cell type.
// Elements without SIMD storage (element/contract.hpp) convert each value with
// Element::to_float.
// Non-finite values follow IEEE arithmetic as the SIMD kernel does: a NaN logit (NaN in
// q or K) or a +inf one makes the row NaN, a -inf logit weighs 0, a NaN in V reaches the
// rows that see the cell; a row that sees no cell is zeros.
#pragma once

#include <cmath>    // std::sqrt, std::exp, std::tanh
#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers
#include <limits>   // infinity

#include "../config.hpp"
#include "../element/contract.hpp"
#include "../format/kv_view.hpp"
#include "../model_shape.hpp"
#include "../simd/tile_io.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace kernels {

/// Arguments of one scalar attention call (cells [0, n); every pointer non-null when n_q > 0).
/// Seqs: the cells' sequence membership, `cell_seqs.test(c, s)`: cell c is used by sequence s.
template <class Seqs>
struct scalar_attn_args {
    const pos_t* cell_pos = nullptr;     ///< per cell position, -1: free
    Seqs cell_seqs{};                    ///< per cell sequence membership
    std::uint32_t n = 0;                 ///< cells to read
    const float* q = nullptr;            ///< n_q rows of n_head x dim_k
    const pos_t* q_pos = nullptr;
    const seq_id_t* q_seq = nullptr;
    std::uint32_t n_q = 0;
    std::uint32_t n_head = 0;            ///< a multiple of kv.n_head_kv
    float scale = 1.0f;                  ///< logit scale (already resolved)
    std::int32_t window = 0;             ///< > 0: sliding window
    float softcap = 0.0f;                ///< > 0: logit soft-cap
    float* out = nullptr;                ///< n_q rows of n_head x dim_v
};

/// One stored value as float: lane `lane` of the storage unit x (lane 0 unless Element
/// is a block element, whose unit holds 32 values).
template <class Element>
inline float element_value(const typename Element::storage_type& x, std::uint32_t lane = 0) noexcept {
    if constexpr (is_block_element<Element>) {
        float f[element_block_size_v<Element>];
        Element::to_float(&x, f, element_block_size_v<Element>);
        return f[lane];
    } else if constexpr (detail::has_simd_storage<Element>) {
        return simd::to_float(x);
    } else {
        float f;
        Element::to_float(&x, &f, 1);
        return f;
    }
}

/// Lane of K dimension d in its storage unit (0 for plain elements).
template <class T>
inline std::uint32_t k_lane(const kv_layer_view<T>& v, std::uint32_t d) noexcept {
    return v.k_row(d) & (v.block() - 1);
}

/// Scalar attention over one layer view; acc: dim_v floats of scratch.
template <class Element, class Seqs>
void attention_scalar(const kv_layer_view<const typename Element::storage_type>& v, const scalar_attn_args<Seqs>& a,
                      float* acc) noexcept {
    const std::uint32_t dk = v.dim_k, dv = v.dim_v, group = a.n_head / v.n_head_kv;
    for (std::uint32_t i = 0; i < a.n_q; ++i) {
        for (std::uint32_t g = 0; g < a.n_head; ++g) {
            const std::uint32_t h = g / group;
            const float* qr = a.q + (std::size_t{i} * a.n_head + g) * dk;
            float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
            bool seen = false;  // some cell visible (else the row is zeros)
            for (std::uint32_t d = 0; d < dv; ++d) acc[d] = 0.0f;
            for (std::uint32_t c = 0; c < a.n; ++c) {
                const pos_t pc = a.cell_pos[c];
                if (pc < 0 || !a.cell_seqs.test(c, a.q_seq[i]) || pc > a.q_pos[i]) continue;
                if (a.window > 0 && std::int64_t{pc} <= std::int64_t{a.q_pos[i]} - a.window) continue;
                seen = true;
                float sc = 0.0f;
                for (std::uint32_t d = 0; d < dk; ++d) sc += qr[d] * element_value<Element>(v.k[v.k_offset(h, c, d)], k_lane(v, d));
                sc *= a.scale;
                if (a.softcap > 0.0f) sc = a.softcap * std::tanh(sc / a.softcap);
                const float nm = sc > m ? sc : m;
                const float alpha = std::exp(m - nm), w = std::exp(sc - nm);
                l = l * alpha + w;
                for (std::uint32_t d = 0; d < dv; ++d)
                    acc[d] = acc[d] * alpha + w * element_value<Element>(v.v[v.v_offset(h, c, d)], d & (v.block() - 1));
                m = nm;
            }
            float* o = a.out + (std::size_t{i} * a.n_head + g) * dv;
            // (A NaN logit makes w, then l and acc, NaN: the row is NaN, as in the SIMD kernel.)
            for (std::uint32_t d = 0; d < dv; ++d) o[d] = seen ? acc[d] / l : 0.0f;
        }
    }
}

}  // namespace kernels
KVCACHE_END_NAMESPACE
