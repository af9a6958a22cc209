// kvcache: token ids and media chunk markers shared by prompts, state files and
// the prompt cache.
#pragma once

#include <cstdint>  // fixed-width integers

#include "../config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A text token id (>= 0). Media placeholder positions hold null_token.
using token_t = std::int32_t;
/// Placeholder token at every position covered by a media chunk.
inline constexpr token_t null_token = -1;

/// A media chunk (image/audio) inside a token list: n_pos placeholder positions
/// starting at `begin`, identified by `id` (a hash of the media content).
struct media_chunk {
    std::uint64_t id = 0;
    std::uint32_t begin = 0;
    std::uint32_t n_pos = 0;
    friend constexpr bool operator==(const media_chunk&, const media_chunk&) = default;
};

KVCACHE_END_NAMESPACE
