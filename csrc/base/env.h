// Settings from the environment, parsed in full (Note [checked settings]):
// the one place C++ reads an environment variable.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

namespace torch_ipc {

// Note [checked settings]
// A setting is parsed in full: "abc", "60s", "1e3" or a value outside its
// range is junk, not the number its first characters spell (atoll made a junk
// TORCH_IPC_IDLE_SECONDS 0, which closed every idle mapping at the next
// collection). A junk number is warned about (the variable, its value, what it
// takes) and its default used: numbers are read while the module loads (the
// per-process state is made then, Note [no first use at fork]), where an
// exception would abort the process instead of raising. A setting that picks
// a mechanism (TORCH_IPC_FD_TRANSPORT) is read where it is used and raises
// InvalidUse: running another mechanism than the one asked for would hide it.

// The variable's value; nullopt when it is unset or empty.
std::optional<std::string> env_string(const char* name);

// An integer in [min, max], surrounding spaces allowed; `fallback` when unset,
// empty or junk (junk warns).
int64_t env_int(const char* name, int64_t fallback, int64_t min, int64_t max);

// A decimal number in [min, max], as env_int.
double env_number(const char* name, double fallback, double min, double max);

// The index in `choices` of the value; `fallback` when unset or empty; throws
// InvalidUse naming the choices for anything else.
size_t env_choice(const char* name, std::initializer_list<const char*> choices, size_t fallback);

}  // namespace torch_ipc
