// SPDX-License-Identifier: MIT
// The public header, alone, from C++.
#include <kvd/kvd.h>

int main() {
	kvd_client *c = nullptr;
	kvd_status *st = nullptr;

	kvd_client_unrefp(&c);
	kvd_status_freep(&st);
	return kvd_version()[0] == '\0';
}
