// kvcache ops: the end of an attention work item: its output rows, or its partial
// softmax state and the split-K merge (flash-decoding).
//
// Layout of the split-K partial states: per work item (head group hg, part k) M slots of
// dv + 2 floats, [m, l, acc[0..dv)], at partial + ((hg * n_split + k) * M + s) * (dv + 2).
#pragma once

#include <algorithm>  // std::max, std::copy
#include <atomic>     // std::atomic_ref
#include <cmath>      // std::exp
#include <cstddef>    // std::size_t
#include <cstdint>    // fixed-width integers
#include <limits>     // infinity

#include "../../config.hpp"
#include "../../kernels/attention.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace ops::detail_attn {

/// Merges the n_split partial softmax states of slot `slot` (= hg * M + s) into its
/// output row o (dv floats; nothing when o is null: a padding slot).
template <std::size_t M>
inline void merge_slot(const float* partial, std::size_t n_split, std::uint32_t dv, std::size_t slot,
                       float* o) noexcept {
    if (o == nullptr) return;
    const float ninf = -std::numeric_limits<float>::infinity();
    const std::size_t hg = slot / M, s = slot % M;
    float mx = ninf;
    for (std::size_t k = 0; k < n_split; ++k) mx = std::max(mx, partial[((hg * n_split + k) * M + s) * (dv + 2)]);
    float l = 0.0f;
    for (std::uint32_t d = 0; d < dv; ++d) o[d] = 0.0f;
    // (No test of mx: a part with l != 0 has a finite m, or a NaN state that must stay NaN.)
    static_cast<void>(ninf);
    for (std::size_t k = 0; k < n_split; ++k) {
        const float* part = partial + ((hg * n_split + k) * M + s) * (dv + 2);
        if (part[1] == 0.0f) continue;
        const float w = std::exp(part[0] - mx);
        l += part[1] * w;
        for (std::uint32_t d = 0; d < dv; ++d) o[d] += part[2 + d] * w;
    }
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;  // (NaN l: NaN row)
    for (std::uint32_t d = 0; d < dv; ++d) o[d] *= inv;
}

/// Merges the n partial softmax states at partial + off[0..n) (each [m, l, acc[0..dv)],
/// in that order) into the output row o (dv floats): the arithmetic of merge_slot, so a
/// row's bits depend only on its states and their order.
inline void merge_list(const float* partial, const std::size_t* off, std::size_t n, std::uint32_t dv,
                       float* o) noexcept {
    float mx = -std::numeric_limits<float>::infinity();
    for (std::size_t k = 0; k < n; ++k) mx = std::max(mx, partial[off[k]]);
    float l = 0.0f;
    for (std::uint32_t d = 0; d < dv; ++d) o[d] = 0.0f;
    for (std::size_t k = 0; k < n; ++k) {
        const float* part = partial + off[k];
        if (part[1] == 0.0f) continue;
        const float w = std::exp(part[0] - mx);
        l += part[1] * w;
        for (std::uint32_t d = 0; d < dv; ++d) o[d] += part[2 + d] * w;
    }
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;  // (NaN l: NaN row)
    for (std::uint32_t d = 0; d < dv; ++d) o[d] *= inv;
}

/// Where the outputs of a call's slots go (ops/attention.hpp fills it): slot s's target
/// (query row x query head, output row out + target * dv) is tgt[s] (npos: padding). A
/// target with one partial state (parts[t] == 1) is written by its item directly; one
/// with several (split-K parts, shared-prefix and own tiles: cascade) keeps each in
/// `partial` at the offsets off[first[t] .. first[t] + parts[t]), in a fixed order, and
/// the item that finishes its last state (done[t] counts them) merges them.
struct slot_targets {
    static constexpr std::uint32_t npos = ~std::uint32_t{0};
    const std::uint32_t* tgt = nullptr;     ///< per slot
    const std::uint32_t* parts = nullptr;   ///< per target: partial states
    const std::size_t* first = nullptr;     ///< per target: its first offset in off
    const std::size_t* off = nullptr;       ///< partial-state offsets (floats into partial)
    std::uint32_t* done = nullptr;          ///< per target: states written (atomic_ref)
    float* partial = nullptr;
    float* out = nullptr;
};

/// The end of a work item whose M slots start at slot0 and whose state is st
/// (accumulators acc, M x dv); partial0: its own M x (dv + 2) partial states (used for
/// the slots whose target merges several).
template <std::size_t M>
inline void finish_slots(const kernels::attn_state<M>& st, const float* acc, std::uint32_t dv, std::size_t slot0,
                         std::size_t partial0, const slot_targets& tg) noexcept {
    for (std::size_t s = 0; s < M; ++s) {
        const std::uint32_t t = tg.tgt[slot0 + s];
        if (t == slot_targets::npos) continue;
        float* o = tg.out + std::size_t{t} * dv;
        if (tg.parts[t] == 1) {
            const float inv = st.l[s] == 0.0f ? 0.0f : 1.0f / st.l[s];  // (NaN l: NaN row)
            for (std::uint32_t d = 0; d < dv; ++d) o[d] = acc[s * dv + d] * inv;
            continue;
        }
        float* part = tg.partial + partial0 + s * (dv + 2);
        part[0] = st.m[s];
        part[1] = st.l[s];
        std::copy(acc + s * dv, acc + s * dv + dv, part + 2);
        // The item that writes a target's last state merges it: no barrier between the
        // items and the merges (acq_rel: the other states are visible to it). The merge
        // reads the states in their fixed order whichever thread runs it.
        if (std::atomic_ref<std::uint32_t>(tg.done[t]).fetch_add(1, std::memory_order_acq_rel) + 1 == tg.parts[t])
            merge_list(tg.partial, tg.off + tg.first[t], tg.parts[t], dv, o);
    }
}

/// The end of a work item (part k of n_split of its group) whose state is st
/// (accumulators acc, M x dv): with one part, its rows' outputs (acc / l; null rows are
/// padding); else its partial state into the group's states `partial` (n_split x M x
/// (dv + 2) floats), and the thread that finishes the group's last part (*parts_done
/// counts them) merges the group. out_rows: the M output rows of the group.
template <std::size_t M>
inline void finish_item(const kernels::attn_state<M>& st, const float* acc, std::uint32_t dv, std::size_t k,
                        std::size_t n_split, float* const* out_rows, float* partial,
                        std::uint32_t* parts_done) noexcept {
    if (n_split == 1) {
        for (std::size_t s = 0; s < M; ++s) {
            float* o = out_rows[s];
            if (o == nullptr) continue;
            const float inv = st.l[s] == 0.0f ? 0.0f : 1.0f / st.l[s];  // (NaN l: NaN row)
            for (std::uint32_t d = 0; d < dv; ++d) o[d] = acc[s * dv + d] * inv;
        }
    } else {
        float* part = partial + k * M * (dv + 2);
        for (std::size_t s = 0; s < M; ++s) {
            part[s * (dv + 2)] = st.m[s];
            part[s * (dv + 2) + 1] = st.l[s];
            std::copy(acc + s * dv, acc + s * dv + dv, part + s * (dv + 2) + 2);
        }
        // The thread that finishes a group's last part merges the group: no barrier
        // between the items and the merge (acq_rel: the other parts' writes are visible
        // to it). The merge reads the parts in order k = 0 .. n_split-1 whichever thread
        // runs it, so its bits do not depend on the threads.
        if (std::atomic_ref<std::uint32_t>(*parts_done).fetch_add(1, std::memory_order_acq_rel) + 1 == n_split)
            for (std::size_t s = 0; s < M; ++s) merge_slot<M>(partial, n_split, dv, s, out_rows[s]);
    }
}

}  // namespace ops::detail_attn
KVCACHE_END_NAMESPACE
