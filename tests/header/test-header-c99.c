/* SPDX-License-Identifier: MIT */
/* The public header, alone, in strict C99 with every warning an error. */
#include <kvd/kvd.h>

int main(void) {
	kvd_client *c = NULL;

	kvd_client_unrefp(&c);
	return kvd_version()[0] == '\0';
}
