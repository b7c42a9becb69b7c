#include "base/env.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string_view>

#include <c10/util/Exception.h>

#include "base/errors.h"
#include "base/str.h"

namespace torch_ipc {
namespace {

std::string_view trimmed(std::string_view s) {
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

// One message built by appends (Note [messages without iostreams] in str.h).
void warn_junk(const char* name, const std::string& value, const std::string& takes, const std::string& fallback) {
  TORCH_WARN(str("torch_ipc: ignoring ", name, "='", value, "': it takes ", takes, "; using the default, ", fallback));
}

// 1000000 rather than %g's 1e+06 for the whole numbers a range is made of.
std::string number_text(int64_t x) { return str(x); }
std::string number_text(double x) {
  return std::nearbyint(x) == x && std::fabs(x) < 1e15 ? str(static_cast<int64_t>(x)) : str(x);
}

// The variable as a T in [min, max] (`what` says which T), read by `parse`
// (strtoll or strtod: (text, &end) -> T) to its very end; `fallback` when unset,
// empty or junk (junk warns).
template <class T, class Parse>
T env_checked(const char* name, T fallback, T min, T max, const char* what, Parse parse) {
  const std::optional<std::string> v = env_string(name);
  if (!v) return fallback;
  const std::string text(trimmed(*v));
  char* end = nullptr;
  errno = 0;
  const T x = parse(text.c_str(), &end);
  const bool whole = !text.empty() && end == text.c_str() + text.size() && errno == 0;
  if (whole && x >= min && x <= max) return x;  // NaN is outside every range
  warn_junk(name, *v, str(what, " from ", number_text(min), " to ", number_text(max)), number_text(fallback));
  return fallback;
}

}  // namespace

std::optional<std::string> env_string(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int64_t env_int(const char* name, int64_t fallback, int64_t min, int64_t max) {
  return env_checked<int64_t>(name, fallback, min, max, "an integer",
                              [](const char* s, char** end) { return std::strtoll(s, end, 10); });
}

double env_number(const char* name, double fallback, double min, double max) {
  return env_checked<double>(name, fallback, min, max, "a number",
                             [](const char* s, char** end) { return std::strtod(s, end); });
}

size_t env_choice(const char* name, std::initializer_list<const char*> choices, size_t fallback) {
  const std::optional<std::string> v = env_string(name);
  if (!v) return fallback;
  std::string list;
  size_t i = 0;
  for (const char* c : choices) {
    if (*v == c) return i;
    list += i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ";
    list += c;
    ++i;
  }
  throw InvalidUse(str("torch_ipc: ", name, " must be ", list, ", not '", *v, "'"));
}

}  // namespace torch_ipc
