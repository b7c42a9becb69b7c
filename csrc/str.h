// torch_ipc::str(args...): the text of its arguments, joined, for error messages.
//
// Note [messages without iostreams]
// Messages are built from std::string appends and std::to_chars, never an
// ostringstream (c10::str uses one). iostreams are the one part of the C++
// library whose layout the headers fix and libstdc++.so implements: an
// extension compiled by a newer GCC than the libstdc++ loaded at run time
// (the GPU machine builds with /opt/gcc, torch loads the system's) crashed the
// first time it formatted a number into a stream, that is, on the first bad
// argument. Appends and to_chars are inline and depend on nothing loaded.
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
