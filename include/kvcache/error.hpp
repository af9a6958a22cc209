// kvcache: the one place that defines and reports errors.
//
// - Invalid configuration and invalid arguments throw kvcache::error, whose
//   message names the parameter and the offending value.
// - Expected failures (cache full) and untrusted input (state files) are
//   reported through a [[nodiscard]] result<T> carrying an errc and a message.
#pragma once

#include <stdexcept>  // std::runtime_error base
#include <string>     // messages
#include <utility>    // std::move
#include <variant>    // result storage

#include "config.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Error codes shared by exceptions and results.
enum class errc : int {
    ok = 0,
    invalid_argument,     ///< a parameter is out of range (message names it)
    invalid_config,       ///< model shape / policy configuration is invalid
    no_space,             ///< not enough free cells for the batch
    batch_too_large,      ///< the batch can never fit (larger than capacity)
    nothing_staged,       ///< commit/restore called with no open placement
    transaction_open,     ///< operation refused while placements are staged
    unsupported,          ///< the layout cannot represent the request
    bad_magic,            ///< state data does not start with the magic
    unsupported_version,  ///< state format version not supported
    truncated,            ///< state data ends early
    shape_mismatch,       ///< state saved for another model shape
    dtype_mismatch,       ///< state saved with another element type
    invalid_cell,         ///< state describes an impossible cell
    checksum_mismatch,    ///< state checksum does not match its contents
    trailing_bytes,       ///< state data continues after its end
    io_error,             ///< file could not be read or written
};

/// Short stable name of an error code (for logs and tests).
constexpr const char* to_string(errc e) noexcept {
    switch (e) {
        case errc::ok: return "ok";
        case errc::invalid_argument: return "invalid_argument";
        case errc::invalid_config: return "invalid_config";
        case errc::no_space: return "no_space";
        case errc::batch_too_large: return "batch_too_large";
        case errc::nothing_staged: return "nothing_staged";
        case errc::transaction_open: return "transaction_open";
        case errc::unsupported: return "unsupported";
        case errc::bad_magic: return "bad_magic";
        case errc::unsupported_version: return "unsupported_version";
        case errc::truncated: return "truncated";
        case errc::shape_mismatch: return "shape_mismatch";
        case errc::dtype_mismatch: return "dtype_mismatch";
        case errc::invalid_cell: return "invalid_cell";
        case errc::checksum_mismatch: return "checksum_mismatch";
        case errc::trailing_bytes: return "trailing_bytes";
        case errc::io_error: return "io_error";
    }
    return "unknown";
}

/// The exception type of the library. what() is "kvcache: <code>: <message>".
class error : public std::runtime_error {
public:
    error(errc code, const std::string& message)
        : std::runtime_error(std::string("kvcache: ") + to_string(code) + ": " + message),
          code_(code) {}
    [[nodiscard]] errc code() const noexcept { return code_; }

private:
    errc code_;
};

/// An error carried by value (see result<T>).
struct error_info {
    errc code = errc::ok;
    std::string message;
};

/// Value-or-error for expected failures. Check ok() before value(); value() on
/// an error throws kvcache::error with the carried code and message.
template <class T>
class [[nodiscard]] result {
public:
    result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
    result(error_info e) : v_(std::move(e)) {}  // NOLINT(google-explicit-constructor)

    [[nodiscard]] bool ok() const noexcept { return v_.index() == 0; }
    explicit operator bool() const noexcept { return ok(); }
    [[nodiscard]] errc code() const noexcept { return ok() ? errc::ok : std::get<1>(v_).code; }
    [[nodiscard]] const std::string& message() const noexcept {
        static const std::string empty;
        return ok() ? empty : std::get<1>(v_).message;
    }
    T& value() & { check(); return std::get<0>(v_); }
    const T& value() const& { check(); return std::get<0>(v_); }
    T&& value() && { check(); return std::get<0>(std::move(v_)); }

private:
    void check() const {
        if (!ok()) throw error(std::get<1>(v_).code, std::get<1>(v_).message);
    }
    std::variant<T, error_info> v_;
};

/// result<void>: only success or an error.
template <>
class [[nodiscard]] result<void> {
public:
    result() = default;
    result(error_info e) : e_(std::move(e)) {}  // NOLINT(google-explicit-constructor)
    [[nodiscard]] bool ok() const noexcept { return e_.code == errc::ok; }
    explicit operator bool() const noexcept { return ok(); }
    [[nodiscard]] errc code() const noexcept { return e_.code; }
    [[nodiscard]] const std::string& message() const noexcept { return e_.message; }
    void value() const {
        if (!ok()) throw error(e_.code, e_.message);
    }

private:
    error_info e_;
};

namespace detail {
/// Throws kvcache::error; the single throw site for argument errors.
[[noreturn]] inline void fail(errc code, const std::string& message) { throw error(code, message); }

/// Builds an error_info for result<T>.
inline error_info make_error(errc code, std::string message) { return {code, std::move(message)}; }
}  // namespace detail

KVCACHE_END_NAMESPACE
