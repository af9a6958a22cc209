// kvcache: block_pool, the reference-counted pool of blocks of the paged layout (paged.hpp).
#pragma once

#include <cstdint>  // std::uint32_t
#include <set>      // free blocks
#include <string>   // messages
#include <vector>   // refcounts

#include "../config.hpp"
#include "../error.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Reference-counted pool of n blocks. Block ids are in [0, n_blocks()).
/// Invariant: free_count() + referenced_count() == n_blocks(); a block is in the
/// free set exactly when its refcount is 0.
class block_pool {
public:
    explicit block_pool(std::uint32_t n_blocks) : refs_(n_blocks, 0) {
        for (std::uint32_t b = 0; b < n_blocks; ++b) free_.insert(free_.end(), b);
    }

    [[nodiscard]] std::uint32_t n_blocks() const noexcept { return static_cast<std::uint32_t>(refs_.size()); }
    [[nodiscard]] std::uint32_t free_count() const noexcept { return static_cast<std::uint32_t>(free_.size()); }
    [[nodiscard]] std::uint32_t referenced_count() const noexcept { return n_blocks() - free_count(); }
    /// Blocks with refcount 0, lowest id first.
    [[nodiscard]] const std::set<std::uint32_t>& free_blocks() const noexcept { return free_; }

    /// Number of sequences referencing block b; throws invalid_argument for b out of range.
    [[nodiscard]] std::uint32_t refcount(std::uint32_t b) const {
        check_id("refcount", b);
        return refs_[b];
    }
    /// Adds one reference to block b (a free block becomes referenced).
    void retain(std::uint32_t b) {
        check_id("retain", b);
        retain_unchecked(b);
    }
    /// Drops one reference; releasing a block whose refcount is already 0 is an error
    /// (errc::invalid_argument, nothing changed), never a silent corruption.
    void release(std::uint32_t b) {
        check_id("release", b);
        if (refs_[b] == 0)
            detail::fail(errc::invalid_argument,
                         "block_pool::release: block " + std::to_string(b) + " is already free (double release)");
        release_unchecked(b);
    }
    /// Empty string when the invariants hold, else a description of the first violation.
    [[nodiscard]] std::string check() const {
        std::uint32_t zero = 0;
        for (std::uint32_t b = 0; b < n_blocks(); ++b) {
            zero += refs_[b] == 0;
            if ((refs_[b] == 0) != (free_.count(b) == 1))
                return "block " + std::to_string(b) + " has refcount " + std::to_string(refs_[b]) +
                       " but is " + (free_.count(b) ? "" : "not ") + "in the free set";
        }
        if (zero != free_count() || free_count() + referenced_count() != n_blocks())
            return "free (" + std::to_string(free_count()) + ") + referenced (" + std::to_string(referenced_count()) +
                   ") != total (" + std::to_string(n_blocks()) + ")";
        return {};
    }

    // Library-internal fast paths (callers guarantee the preconditions).
    void retain_unchecked(std::uint32_t b) {
        if (refs_[b]++ == 0) free_.erase(b);
    }
    void release_unchecked(std::uint32_t b) {
        KVCACHE_ASSERT(refs_[b] > 0);
        if (--refs_[b] == 0) free_.insert(b);
    }
    void reset() {
        for (std::uint32_t b = 0; b < n_blocks(); ++b) {
            refs_[b] = 0;
            free_.insert(b);
        }
    }

private:
    void check_id(const char* fn, std::uint32_t b) const {
        if (b >= n_blocks())
            detail::fail(errc::invalid_argument, std::string("block_pool::") + fn + ": block = " + std::to_string(b) +
                                                     ", must be < n_blocks = " + std::to_string(n_blocks()));
    }

    std::vector<std::uint32_t> refs_;  // sequences referencing each block
    std::set<std::uint32_t> free_;     // exactly the blocks with refs_ == 0
};

KVCACHE_END_NAMESPACE
