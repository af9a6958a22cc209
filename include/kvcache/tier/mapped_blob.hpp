// kvcache tier: mapped_blob, a blob read in place instead of copied out (a storage tier's
// optional map(): tier/tier.hpp).
//
// A mapped_blob either owns a read-only memory mapping of a file (disk_tier::map: the
// kernel's page cache, no copy; unmapped by the destructor) or lends bytes its tier holds
// (memory_tier::map: valid until that tier is next changed). owns() tells which: only an
// owned blob may outlive its tier's next call.
// Risk of a mapping: when something outside the library truncates a mapped file in place
// (the library itself only replaces files by rename and removes them by unlink, which
// leave a mapping intact), reading the cut-off pages raises SIGBUS.
#pragma once

#include <sys/mman.h>  // munmap

#include <cstddef>  // std::byte, std::size_t
#include <span>     // the bytes
#include <utility>  // std::exchange

#include "../config.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace tier {

/// The bytes of one blob, mapped (owned) or lent by its tier (see above). Move-only.
class mapped_blob {
public:
    mapped_blob() = default;
    /// Takes ownership of the mapping [addr, addr + size) (from mmap; munmap'd on destruction).
    [[nodiscard]] static mapped_blob adopt_mapping(void* addr, std::size_t size) noexcept {
        mapped_blob m;
        m.data_ = static_cast<const std::byte*>(addr);
        m.size_ = size;
        m.mapped_ = true;
        return m;
    }
    /// Lends `bytes` (owned by the tier; valid until it is next changed).
    [[nodiscard]] static mapped_blob lend(std::span<const std::byte> bytes) noexcept {
        mapped_blob m;
        m.data_ = bytes.data();
        m.size_ = bytes.size();
        return m;
    }
    mapped_blob(mapped_blob&& o) noexcept
        : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), mapped_(std::exchange(o.mapped_, false)) {}
    mapped_blob& operator=(mapped_blob&& o) noexcept {
        if (this != &o) {
            reset();
            data_ = std::exchange(o.data_, nullptr);
            size_ = std::exchange(o.size_, 0);
            mapped_ = std::exchange(o.mapped_, false);
        }
        return *this;
    }
    mapped_blob(const mapped_blob&) = delete;
    mapped_blob& operator=(const mapped_blob&) = delete;
    ~mapped_blob() { reset(); }

    [[nodiscard]] std::span<const std::byte> bytes() const noexcept { return {data_, size_}; }
    [[nodiscard]] std::size_t size() const noexcept { return size_; }
    /// Whether the bytes are this object's own mapping (they outlive the tier's next call).
    [[nodiscard]] bool owns() const noexcept { return mapped_; }
    /// Unmaps (or forgets lent bytes); empty afterwards.
    void reset() noexcept {
        if (mapped_ && size_ > 0) ::munmap(const_cast<std::byte*>(data_), size_);
        data_ = nullptr;
        size_ = 0;
        mapped_ = false;
    }

private:
    const std::byte* data_ = nullptr;
    std::size_t size_ = 0;
    bool mapped_ = false;
};

}  // namespace tier
KVCACHE_END_NAMESPACE
