// kvcache tier: the storage-tier concept (content-addressed blobs under the global prompt
// cache) and memory_tier, the in-process tier.
//
// Required members of a storage tier T (checked by storage_tier<T>):
//   1. result<void> put(const key&, std::span<const std::byte> blob);  stores (or replaces)
//      the blob; an error (no room, I/O, server down) leaves the tier without it
//   2. bool get(const key&, std::vector<std::byte>& out);   true and the bytes when held;
//      false for a miss, an unreachable store or an unreadable blob (never throws for those)
//   3. bool contains(const key&);                            whether get would find it
//   4. bool erase(const key&);                               false when not held
//   5. std::size_t bytes() const;                            bytes held (as far as known)
//   6. std::string_view name() const;                        Prometheus label ("memory", "disk", "redis")
// Optional members, used by tier_cache where a tier has them:
//   7. bool map(const key&, mapped_blob& out);   as get, but the bytes read in place
//      (tier/mapped_blob.hpp: disk_tier maps its file, memory_tier lends its bytes): a hit
//      costs no copy; tier_cache prefers it to get
//   8. result<void> put(const key&, std::vector<std::byte>&& blob);  as put, taking the
//      bytes (memory_tier keeps the vector: a promotion costs no copy); tier_cache calls
//      put with an rvalue vector where it can give one up (a tier without the overload
//      gets it as a span)
// A tier checks nothing inside the blobs it holds: tier_cache verifies every blob it gets
// (tier/blob.hpp) and erases the ones it refuses.
#pragma once

#include <concepts>       // std::same_as
#include <cstddef>        // std::byte, std::size_t
#include <cstring>        // std::memcpy
#include <list>           // LRU order
#include <span>           // blob bytes
#include <string_view>    // name
#include <unordered_map>  // blobs by key
#include <utility>        // std::move
#include <vector>         // blob bytes

#include "../error.hpp"
#include "buffer.hpp"
#include "key.hpp"
#include "mapped_blob.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace tier {

template <class T>
concept storage_tier = requires(T& t, const T& ct, const key& k, std::span<const std::byte> b, std::vector<std::byte>& out) {
    { t.put(k, b) } -> std::same_as<result<void>>;
    { t.get(k, out) } -> std::same_as<bool>;
    { t.contains(k) } -> std::convertible_to<bool>;
    { t.erase(k) } -> std::convertible_to<bool>;
    { ct.bytes() } -> std::convertible_to<std::size_t>;
    { ct.name() } -> std::convertible_to<std::string_view>;
};

/// Whether tier T has the optional map() (member 7 above).
template <class T>
concept mappable_tier = requires(T& t, const key& k, mapped_blob& out) {
    { t.map(k, out) } -> std::same_as<bool>;
};

/// Blobs in this process's memory under a byte limit, least recently used evicted first.
/// Thread safety: not thread-safe.
class memory_tier {
public:
    /// limit_bytes = 0: no limit. A blob larger than the limit is refused (no_space).
    explicit memory_tier(std::size_t limit_bytes = 0) : limit_(limit_bytes) {}

    result<void> put(const key& k, std::span<const std::byte> blob) {
        if (const result<void> r = check_size(blob.size()); !r) return r;
        std::vector<std::byte> bytes;
        kvcache::detail::resize_blob_buffer(bytes, blob.size());
        if (!blob.empty()) std::memcpy(bytes.data(), blob.data(), blob.size());
        return put(k, std::move(bytes));
    }
    /// As put, keeping `blob` itself (no copy). On an error blob is left as it was.
    result<void> put(const key& k, std::vector<std::byte>&& blob) {
        if (const result<void> r = check_size(blob.size()); !r) return r;
        erase(k);
        lru_.push_front(k);
        const std::size_t n = blob.size();
        map_.emplace(k, item{std::move(blob), lru_.begin()});
        bytes_ += n;
        while (limit_ > 0 && bytes_ > limit_) {
            erase(lru_.back());
            ++evictions_;
        }
        return {};
    }
    bool get(const key& k, std::vector<std::byte>& out) {
        const auto it = map_.find(k);
        if (it == map_.end()) return false;
        lru_.splice(lru_.begin(), lru_, it->second.pos);
        const std::vector<std::byte>& b = it->second.bytes;
        kvcache::detail::resize_blob_buffer(out, b.size());
        if (!b.empty()) std::memcpy(out.data(), b.data(), b.size());
        return true;
    }
    /// As get, lending the held bytes (out.owns() is false): valid until this tier is next
    /// changed (put, erase, an eviction).
    bool map(const key& k, mapped_blob& out) {
        const auto it = map_.find(k);
        if (it == map_.end()) return false;
        lru_.splice(lru_.begin(), lru_, it->second.pos);
        out = mapped_blob::lend(it->second.bytes);
        return true;
    }
    [[nodiscard]] bool contains(const key& k) const { return map_.contains(k); }
    bool erase(const key& k) {
        const auto it = map_.find(k);
        if (it == map_.end()) return false;
        bytes_ -= it->second.bytes.size();
        lru_.erase(it->second.pos);
        map_.erase(it);
        return true;
    }
    [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
    [[nodiscard]] std::size_t size() const noexcept { return map_.size(); }
    /// Blobs evicted by the byte limit.
    [[nodiscard]] std::size_t evictions() const noexcept { return evictions_; }
    [[nodiscard]] std::string_view name() const noexcept { return "memory"; }

private:
    result<void> check_size(std::size_t n) const {
        if (limit_ > 0 && n > limit_)
            return kvcache::detail::make_error(errc::no_space, "memory_tier::put: blob of " + std::to_string(n) +
                                                                   " bytes exceeds the limit of " + std::to_string(limit_));
        return {};
    }
    struct item {
        std::vector<std::byte> bytes;
        std::list<key>::iterator pos;
    };
    std::size_t limit_;
    std::size_t bytes_ = 0;
    std::size_t evictions_ = 0;
    std::list<key> lru_;  // most recent first
    std::unordered_map<key, item, key_hash> map_;
};

}  // namespace tier
KVCACHE_END_NAMESPACE
