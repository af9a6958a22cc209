// kvcache: the strong guarantee for compound operations (context shift, Self-Extend,
// reuse plans, defragmentation, state loading).
//
// A memory (kv_cache, iswa_cache) saves everything a rollback needs into its
// `checkpoint` (a journaled rollback point of the cell table, the layout's tables and
// hints, slot-search head) and puts it back without allocating. with_rollback runs a
// multi-step operation so that an error result or a throw (std::bad_alloc included)
// leaves the memory as it was; K/V bytes of occupied cells are not saved, so the
// operation must write them only after its last step that can fail (every compound
// operation of the library does).
#pragma once

#include <utility>  // std::forward

#include "../config.hpp"
#include "../detail/policy_select.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace detail {

/// Runs f() (returning a result<...>) on memory m with the strong guarantee.
template <class Memory, class F>
auto with_rollback(Memory& m, F&& f) -> decltype(f()) {
    typename Memory::checkpoint cp;
    m.save_checkpoint(cp, internal_access{});  // may throw: nothing changed yet
    try {
        auto r = std::forward<F>(f)();
        if (!r) m.load_checkpoint(cp, internal_access{});
        return r;
    } catch (...) {
        m.load_checkpoint(cp, internal_access{});
        throw;
    }
}

}  // namespace detail
KVCACHE_END_NAMESPACE
