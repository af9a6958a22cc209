// kvcache ops on recurrent and hybrid memories: memory accounting (ops::memory) and the
// K-shift of a hybrid memory's attention part (ops::apply_k_shift). Attention itself runs
// on hybrid_memory::attention() (ops::attention takes it as it is); a recurrent state has
// no K to rotate and no attention to run.
#pragma once

#include <cstddef>  // std::size_t

#include "../config.hpp"
#include "../detail/policy_select.hpp"
#include "../kernels/path.hpp"
#include "../memory/hybrid.hpp"
#include "../memory/recurrent.hpp"
#include "kshift.hpp"
#include "memory.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace ops {

/// Memory accounting of a recurrent memory: reserved = the state buffer; used = held = the
/// states of the sequences that hold positions (an empty sequence's slot is free).
[[nodiscard]] inline memory_usage memory(const recurrent_memory& mem) {
    memory_usage m;
    m.reserved_bytes = mem.total_bytes();
    std::size_t n = 0;
    for (seq_id_t s = 0; static_cast<std::uint32_t>(s) < mem.n_seq_max(); ++s) n += mem.seq_pos_max(s) >= 0;
    m.used_bytes = m.held_bytes = n * mem.shape().seq_floats() * sizeof(float);
    return m;
}

/// Memory accounting of a hybrid memory: the sum of its attention and recurrent parts.
template <class Attention>
[[nodiscard]] memory_usage memory(const hybrid_memory<Attention>& mem) {
    const memory_usage a = ops::memory(mem.attention()), r = ops::memory(mem.recurrent());
    return {a.reserved_bytes + r.reserved_bytes, a.used_bytes + r.used_bytes, a.held_bytes + r.held_bytes};
}

/// Applies the pending K-shift of a hybrid memory's attention part (after seq_add /
/// seq_div); the recurrent part has none. Errors as ops::apply_k_shift on the attention memory.
template <class Attention>
void apply_k_shift(hybrid_memory<Attention>& mem, int n_threads = 0, kernel_path path = kernel_path::simd) {
    ops::apply_k_shift(mem.attention_for_update(kvcache::detail::internal_access{}), n_threads, path);
}

}  // namespace ops
KVCACHE_END_NAMESPACE
