use strict;
use threads;
use threads::shared;
use POSIX ();
my $ready :shared = 0;
my @a = map { "" . $_ } 1 .. 100;
my @b = map { "" . $_ } 1 .. 100;
sub fill_a {
    $_ = "a" x 30000 for @a;
}
sub fill_b {
    $_ = "b" x 50000 for @b;
}
sub run {
    my ($fill) = @_;
    $fill->();
    lock($ready);
    $ready++;
    cond_broadcast($ready);
    cond_wait($ready) while 1;
}
threads->create(\&run, \&fill_a);
threads->create(\&run, \&fill_b);
{
    lock($ready);
    cond_wait($ready) until $ready == 2;
}
POSIX::_exit(0);
