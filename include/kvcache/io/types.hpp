// kvcache io: what a load returns and the limits it applies (io/state.hpp).
#pragma once

#include <cstdint>  // fixed-width integers
#include <vector>   // cells, tokens

#include "../model_shape.hpp"
#include "../tokens/token.hpp"
#include "format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

/// What a successful load restored.
struct load_info {
    state_kind kind = state_kind::whole_cache;
    seq_id_t saved_seq = -1;             ///< sequence the bytes were saved from (one_sequence), else -1
    std::vector<std::uint32_t> cells;    ///< cell that saved cell i went to
    std::vector<token_t> tokens;         ///< prompt tokens stored with the state (may be empty)
    std::vector<media_chunk> media;      ///< media chunks covering null_token positions of `tokens`
};

/// Limits applied while loading untrusted bytes.
struct load_options {
    /// Largest token list accepted (errc::no_space beyond it). Positions are 31-bit, so
    /// the default accepts every list a cache can describe.
    std::uint64_t max_tokens = std::uint64_t{1} << 31;
};

}  // namespace io
KVCACHE_END_NAMESPACE
