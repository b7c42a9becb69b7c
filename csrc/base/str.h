// torch_ipc::str(args...): the text of its arguments, joined, for error messages.
//
// Note [messages without iostreams]
// Messages are built from std::string appends and std::to_chars, never an
// ostringstream (c10::str uses one). Built with GCC 13.3 against the torch
// 2.11+cu130 wheel on the GPU machine, the extension crashed (SIGSEGV) at the
// first message c10::str formatted, with or without the GIL, on any thread:
// that is, at the first bad argument. Why is not known (the iostreams that
// inline code instantiates come from the libstdc++ loaded with torch); the
// same messages built by appends run everywhere, and depend on nothing loaded.
#pragma once
#include <charconv>
#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace torch_ipc {
namespace detail {

template <typename T, typename = void>
struct has_str : std::false_type {};
template <typename T>
struct has_str<T, std::void_t<decltype(std::string(std::declval<const T&>().str()))>> : std::true_type {};

template <typename T>
void append_one(std::string& out, const T& value) {
  using V = std::decay_t<T>;
  if constexpr (std::is_same_v<V, bool>) {
    out += value ? "true" : "false";
  } else if constexpr (std::is_same_v<V, char>) {
    out += value;
  } else if constexpr (std::is_enum_v<V>) {
    append_one(out, static_cast<std::underlying_type_t<V>>(value));
  } else if constexpr (std::is_integral_v<V>) {
    char buf[24];
    auto r = std::to_chars(buf, buf + sizeof(buf), value);
    out.append(buf, r.ptr);
  } else if constexpr (std::is_floating_point_v<V>) {
    char buf[32];
    int n = std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(value));
    out.append(buf, n > 0 ? static_cast<size_t>(n) : 0);
  } else if constexpr (has_str<V>::value) {
    out += value.str();  // c10::Device and the like
  } else {
    static_assert(std::is_convertible_v<const T&, std::string_view>,
                  "torch_ipc::str takes strings, characters, numbers, enums and types with str()");
    out += std::string_view(value);
  }
}

}  // namespace detail

template <typename... Args>
std::string str(const Args&... args) {
  std::string out;
  (detail::append_one(out, args), ...);
  return out;
}

}  // namespace torch_ipc
