// kvcache: state_store, an entry store of the global prompt cache that keeps each
// entry as the bytes of io::save_seq (the state format of F15, with its checksum)
// and loads it with io::load_seq, which validates everything before touching the
// cache. Works with every memory io:: takes, composite ones (iswa_cache) included: the
// default entry store of slot_manager over an ISWA cache.
#pragma once

#include <cstddef>  // std::byte, std::size_t
#include <span>     // state bytes
#include <string>   // messages
#include <vector>   // state bytes

#include "../error.hpp"
#include "../io/state.hpp"
#include "../memory/memory.hpp"
#include "../model_shape.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Keeps an entry as the bytes of io::save_seq (state format with checksum) and loads it
/// back with io::load_seq, which validates everything before touching the cache.
/// Thread safety: stateless; save reads the cache, load changes it (exclusive access).
template <class Cache>
class state_store {
    static_assert(memory<Cache>, "kvcache: state_store<Cache> needs a kvcache::memory (see kvcache/memory/memory.hpp)");

public:
    /// Handles are plain data: copying one copies the saved state.
    static constexpr bool copyable_handles = true;
    /// The serialised sequence.
    struct handle {
        std::vector<std::byte> bytes;
    };

    result<handle> save(Cache& cache, seq_id_t seq) { return handle{io::save_seq(cache, seq)}; }
    result<void> load(Cache& cache, seq_id_t dst, const handle& h) {
        if (cache.seq_pos_max(dst) >= 0)
            return detail::make_error(errc::invalid_argument,
                                      "state_store::load: destination sequence " + std::to_string(dst) + " is not empty");
        auto r = io::load_seq(cache, dst, std::span<const std::byte>(h.bytes));
        if (!r) return detail::make_error(r.code(), "state_store::load: " + r.message());
        return {};
    }
    [[nodiscard]] std::size_t bytes(const Cache&, const handle& h) const noexcept { return h.bytes.size(); }
    void release(Cache&, handle& h) noexcept { h = handle{}; }
};

KVCACHE_END_NAMESPACE
