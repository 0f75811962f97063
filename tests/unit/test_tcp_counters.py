"""What TCP did on an emulated host (experiments.runtime.netns.tcp_counters), read from the
text of its namespace's /proc/net/snmp and /proc/net/netstat."""

import pytest

from experiments.runtime.netns import tcp_counters

SNMP = """Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 4711
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors
Tcp: 1 200 120000 -1 8 0 0 2 4 65000 67771 634 0 3 0
Udp: InDatagrams NoPorts
Udp: 0 0
"""
NETSTAT = """TcpExt: SyncookiesSent SyncookiesRecv TCPTimeouts TCPLossProbes
TcpExt: 0 0 5 7
IpExt: InNoRoutes InTruncatedPkts
IpExt: 0 0
"""


def test_the_segments_sent_sent_again_and_the_timeouts_are_read_by_name():
    assert tcp_counters(SNMP, NETSTAT) == {"segments_out": 67771, "retransmitted": 634, "timeouts": 5}


def test_a_missing_or_unreadable_counter_is_named():
    with pytest.raises(ValueError, match="TcpExt TCPTimeouts"):
        tcp_counters(SNMP, NETSTAT.replace("TCPTimeouts", "TCPOther"))
    with pytest.raises(ValueError, match="Tcp RetransSegs"):
        tcp_counters(SNMP.replace(" 634 ", " x "), NETSTAT)
