// kvcache: a prompt's token list, which may contain media chunks (F18).
//
// Text positions hold a token id >= 0. A media chunk (image, audio) covers n_pos
// consecutive positions, each holding null_token, and is identified by its id
// (a hash of the media content). Invariants kept by every member function:
//   - chunks are sorted by begin, do not overlap and lie inside the list;
//   - a position holds null_token exactly when a chunk covers it.
// So a list can never be cut through a chunk, and two lists compare media by
// (id, n_pos), whole chunks at a time.
#pragma once

#include <algorithm>  // std::mismatch, std::upper_bound
#include <cstddef>    // std::size_t
#include <cstdint>    // fixed-width integers, UINT32_MAX
#include <initializer_list>  // text literals
#include <iterator>   // std::prev
#include <span>       // views
#include <string>     // messages
#include <vector>     // storage

#include "../error.hpp"
#include "token.hpp"

KVCACHE_BEGIN_NAMESPACE

/// A prompt: text tokens and media chunks in position order (F18).
class prompt_tokens {
public:
    prompt_tokens() = default;

    /// A text-only prompt. Throws kvcache::error(invalid_argument) naming the first token < 0.
    explicit prompt_tokens(std::span<const token_t> text) {
        for (std::size_t i = 0; i < text.size(); ++i)
            if (text[i] < 0) bad("prompt_tokens", "token[" + std::to_string(i) + "] = " + std::to_string(text[i]) +
                                                      ", text tokens must be >= 0");
        tokens_.assign(text.begin(), text.end());
    }
    prompt_tokens(std::initializer_list<token_t> text)
        : prompt_tokens(std::span<const token_t>(text.begin(), text.size())) {}

    /// Builds a prompt from raw tokens (null_token at media positions) and the media chunks
    /// covering them. Throws kvcache::error(invalid_argument) describing the first problem:
    /// a negative token other than null_token, a chunk with n_pos = 0, out of range, out of
    /// order or overlapping, a null_token no chunk covers, or a chunk over a text token.
    static prompt_tokens from(std::span<const token_t> tokens, std::span<const media_chunk> media) {
        prompt_tokens p;
        std::uint64_t next_free = 0;  // first position after the previous chunk
        for (std::size_t m = 0; m < media.size(); ++m) {
            const media_chunk& c = media[m];
            const std::string name = "media[" + std::to_string(m) + "]";
            if (c.n_pos == 0) bad("prompt_tokens::from", name + ".n_pos = 0, must be >= 1");
            if (std::uint64_t{c.begin} + c.n_pos > tokens.size())
                bad("prompt_tokens::from", name + " covers [" + std::to_string(c.begin) + ", " +
                                               std::to_string(std::uint64_t{c.begin} + c.n_pos) +
                                               ") beyond the " + std::to_string(tokens.size()) + " tokens");
            if (c.begin < next_free)
                bad("prompt_tokens::from", name + ".begin = " + std::to_string(c.begin) +
                                               " overlaps or precedes the previous chunk (ends at " +
                                               std::to_string(next_free) + ")");
            for (std::uint32_t k = 0; k < c.n_pos; ++k)
                if (tokens[c.begin + k] != null_token)
                    bad("prompt_tokens::from", name + " covers position " + std::to_string(c.begin + k) +
                                                   " which holds text token " + std::to_string(tokens[c.begin + k]));
            next_free = std::uint64_t{c.begin} + c.n_pos;
        }
        std::size_t m = 0;
        for (std::size_t i = 0; i < tokens.size(); ++i) {
            while (m < media.size() && std::uint64_t{media[m].begin} + media[m].n_pos <= i) ++m;
            const bool covered = m < media.size() && media[m].begin <= i;
            if (tokens[i] == null_token && !covered)
                bad("prompt_tokens::from", "token[" + std::to_string(i) + "] is null_token but no media chunk covers it");
            if (tokens[i] < 0 && tokens[i] != null_token)
                bad("prompt_tokens::from", "token[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                                               ", must be >= 0 or null_token");
        }
        p.tokens_.assign(tokens.begin(), tokens.end());
        p.media_.assign(media.begin(), media.end());
        return p;
    }

    // ------------------------------------------------------------------ queries

    /// Number of positions (text tokens + media placeholder positions).
    [[nodiscard]] std::size_t size() const noexcept { return tokens_.size(); }
    [[nodiscard]] bool empty() const noexcept { return tokens_.empty(); }
    /// Whether some media chunk is present (disables chunk reuse, F20).
    [[nodiscard]] bool has_media() const noexcept { return !media_.empty(); }
    /// Token at position i (null_token inside media). i < size().
    [[nodiscard]] token_t operator[](std::size_t i) const noexcept {
        KVCACHE_ASSERT(i < tokens_.size());
        return tokens_[i];
    }
    /// Every position's token (null_token inside media).
    [[nodiscard]] std::span<const token_t> tokens() const noexcept { return tokens_; }
    /// Media chunks in position order.
    [[nodiscard]] std::span<const media_chunk> media() const noexcept { return media_; }

    /// The chunk covering position i, or nullptr for a text position (or i >= size()).
    [[nodiscard]] const media_chunk* chunk_at(std::size_t i) const noexcept {
        if (i >= tokens_.size() || tokens_[i] != null_token) return nullptr;
        auto it = std::upper_bound(media_.begin(), media_.end(), i,
                                   [](std::size_t p, const media_chunk& c) { return p < c.begin; });
        KVCACHE_ASSERT(it != media_.begin());
        return &*std::prev(it);
    }
    /// Whether keep_first(n) would cut through a chunk (n strictly inside one).
    [[nodiscard]] bool cuts_chunk(std::size_t n) const noexcept {
        if (n == 0 || n >= tokens_.size()) return false;
        const media_chunk* c = chunk_at(n);
        return c != nullptr && c->begin < n;
    }
    /// Largest n' <= n that does not cut through a chunk (the start of the chunk n is inside).
    [[nodiscard]] std::size_t chunk_floor(std::size_t n) const noexcept {
        if (!cuts_chunk(n)) return n;
        return chunk_at(n)->begin;
    }

    // ---------------------------------------------------------------- mutations

    /// Appends a text token (>= 0); throws kvcache::error(invalid_argument) otherwise.
    void push_back(token_t t) {
        if (t < 0) bad("prompt_tokens::push_back", "token = " + std::to_string(t) + ", text tokens must be >= 0");
        tokens_.push_back(t);
    }
    /// Appends text tokens (all validated first; nothing is appended on error).
    void append(std::span<const token_t> text) {
        for (std::size_t i = 0; i < text.size(); ++i)
            if (text[i] < 0)
                bad("prompt_tokens::append", "token[" + std::to_string(i) + "] = " + std::to_string(text[i]) +
                                                 ", text tokens must be >= 0");
        tokens_.insert(tokens_.end(), text.begin(), text.end());
    }
    /// Appends a media chunk of n_pos >= 1 positions identified by id.
    void push_media(std::uint64_t id, std::uint32_t n_pos) {
        if (n_pos == 0) bad("prompt_tokens::push_media", "n_pos = 0, must be >= 1");
        if (tokens_.size() + n_pos > std::size_t{UINT32_MAX})
            bad("prompt_tokens::push_media", "n_pos = " + std::to_string(n_pos) + " makes the prompt longer than 2^32");
        media_.push_back({id, static_cast<std::uint32_t>(tokens_.size()), n_pos});
        tokens_.insert(tokens_.end(), n_pos, null_token);
    }
    /// Keeps the first n positions. Throws kvcache::error(invalid_argument) if n > size()
    /// or if n falls strictly inside a media chunk (the prompt is then unchanged).
    void keep_first(std::size_t n) {
        if (n > tokens_.size())
            bad("prompt_tokens::keep_first", "n = " + std::to_string(n) + " exceeds size " + std::to_string(size()));
        if (cuts_chunk(n)) {
            const media_chunk* c = chunk_at(n);
            bad("prompt_tokens::keep_first", "n = " + std::to_string(n) + " cuts through media chunk [" +
                                                 std::to_string(c->begin) + ", " + std::to_string(c->begin + c->n_pos) +
                                                 ") (id " + std::to_string(c->id) + "); keep a chunk whole or drop it");
        }
        while (!media_.empty() && media_.back().begin >= n) media_.pop_back();
        tokens_.resize(n);
    }
    /// Removes every position.
    void clear() noexcept {
        tokens_.clear();
        media_.clear();
    }

    /// Length of the longest common prefix of *this and b: text tokens compare by id,
    /// media chunks by (id, n_pos) as a whole, so the result never ends inside a chunk.
    [[nodiscard]] std::size_t common_prefix(const prompt_tokens& b) const noexcept {
        const std::size_t n = std::min(size(), b.size());
        if (!has_media() && !b.has_media())
            return static_cast<std::size_t>(
                std::mismatch(tokens_.begin(), tokens_.begin() + static_cast<std::ptrdiff_t>(n), b.tokens_.begin())
                    .first -
                tokens_.begin());
        std::size_t ma = 0, mb = 0;  // next chunk of a / b (positions advance chunk by chunk)
        std::size_t i = 0;
        while (i < n) {
            const token_t x = tokens_[i], y = b.tokens_[i];
            if (x == null_token && y == null_token) {
                const media_chunk& ca = media_[ma];
                const media_chunk& cb = b.media_[mb];
                KVCACHE_ASSERT(ca.begin == i && cb.begin == i);
                if (ca.id != cb.id || ca.n_pos != cb.n_pos) return i;
                i += ca.n_pos;
                ++ma;
                ++mb;
                continue;
            }
            if (x != y) return i;
            ++i;
        }
        return n;
    }

    friend bool operator==(const prompt_tokens& a, const prompt_tokens& b) noexcept {
        return a.tokens_ == b.tokens_ && a.media_ == b.media_;
    }

private:
    [[noreturn]] static void bad(const char* fn, const std::string& what) {
        detail::fail(errc::invalid_argument, std::string(fn) + ": " + what);
    }

    std::vector<token_t> tokens_;     // null_token exactly at positions covered by media_
    std::vector<media_chunk> media_;  // sorted by begin, disjoint, inside tokens_
};

/// Free-function form of prompt_tokens::common_prefix (F18).
[[nodiscard]] inline std::size_t common_prefix(const prompt_tokens& a, const prompt_tokens& b) noexcept {
    return a.common_prefix(b);
}

KVCACHE_END_NAMESPACE
