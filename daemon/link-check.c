/* SPDX-License-Identifier: MIT */
/*
 * The body of the daemon's link checks (meson.build): each links one component whole with
 * only the components below it, so that the link fails on a call against the direction.
 * Nothing runs: the check is the link.
 */
int main(void) {
	return 0;
}
